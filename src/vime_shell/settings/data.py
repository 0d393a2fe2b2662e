"""The prompts (section ``data``): the dataset or built-in task, its row fields, order and
passes.

Example: ``DataArgs(num_epoch=2)`` raises ``num_epoch=2: needs --prompt-data. Fix: pass
--num-rollout with a built-in task.``
"""

import attrs

from vime_pure.errors import field_error
from vime_shell.rollout.sft import LOSS_MASK_TYPES
from vime_shell.rollout.tasks import TASKS
from vime_shell.settings.common import ConfigError, Record, at_least, setting

SECTION = "data"
DEFAULT_LABEL_KEY = "label"  # a dataset row's reference answer (SFT rows need none)
MAX_SEED = 2**63  # torch and numpy seeds are 64-bit


def _f(default, help, choices=None):
    return setting(default, help, SECTION, choices)


def check_seed(name: str, value: int | None) -> None:
    """A seed torch and numpy both take: ``0 <= value < 2**63``."""
    at_least(name, value, 0)
    if value is not None and value >= MAX_SEED:
        raise field_error(ConfigError, name, value, "must be below 2**63",
                          "pass a smaller seed, e.g. 0")


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class DataArgs(Record):
    """Where prompts and labels come from."""

    prompt_data: str | None = _f(None, "prompt dataset, .jsonl or .parquet; default: the "
                                 "built-in --task")
    input_key: str = _f("prompt", "row field holding the prompt (text or chat messages)")
    label_key: str | None = _f(DEFAULT_LABEL_KEY, "row field holding the reference answer")
    metadata_key: str | None = _f(None, "row field holding a metadata dict")
    tool_key: str | None = _f(None, "row field holding tools for the chat template")
    apply_chat_template: bool = _f(False, "render prompts with the tokenizer's chat template")
    loss_mask_type: str | None = _f(None, "how sft_rollout finds a conversation's trained "
                                    "tokens: qwen / qwen3 (default) render it turn by turn; "
                                    "qwen3_5 renders it once and marks each assistant turn's "
                                    "text (templates that rewrite earlier turns); "
                                    "distill_qwen trains the last message after the first",
                                    tuple(LOSS_MASK_TYPES))
    rollout_shuffle: bool = _f(False, "shuffle the dataset each epoch (seeded, resumable)")
    rollout_seed: int | None = _f(None, "seed of prompt order and sampling; default --seed")
    num_epoch: int | None = _f(None, "passes over the dataset; sets the rollout count when "
                               "--num-rollout is not given (slime's rule)")
    task: str = _f("reverse2", "built-in task supplying prompts and labels without "
                   "--prompt-data", tuple(TASKS))
    rollout_max_prompt_len: int | None = _f(None, "drop --prompt-data prompts longer than this "
                                            "many tokens at launch (counted in the log), as "
                                            "slime; default: keep all, and refuse a prompt "
                                            "that leaves no room for the response in the "
                                            "model's context")

    def _check(self) -> None:
        check_seed("rollout_seed", self.rollout_seed)
        at_least("num_epoch", self.num_epoch, 1)
        at_least("rollout_max_prompt_len", self.rollout_max_prompt_len, 1)
        if self.num_epoch is not None and self.prompt_data is None:
            raise field_error(ConfigError, "num_epoch", self.num_epoch, "needs --prompt-data",
                              "pass --num-rollout with a built-in task")
