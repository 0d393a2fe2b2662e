"""Checkpoints, rollout dumps and replay, HF export, and the debugging modes built on them
(section ``checkpoint``).

Example: ``CheckpointArgs(save_rollout_data="dump.npz")`` raises ``save_rollout_data='dump.npz':
lacks {rollout_id}: every rollout would overwrite one file ...``.
"""

import attrs

from vime_pure.errors import field_error
from vime_shell.settings.common import ConfigError, Record, at_least, setting

SECTION = "checkpoint"
SAVE_HF_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


def _f(default, help, choices=None):
    return setting(default, help, SECTION, choices)


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class CheckpointArgs(Record):
    """What the run saves and loads."""

    save: str | None = _f(None, "checkpoint directory")
    save_interval: int = _f(50, "rollouts between checkpoints")
    load: str | None = _f(None, "checkpoint directory to resume from")
    save_rollout_data: str | None = _f(None, "dump every rollout batch to this path template "
                                       "(must contain {rollout_id})")
    load_rollout_data: str | None = _f(None, "replay dumps from this path template (or one "
                                       "literal path, replayed every rollout)")
    load_rollout_data_mode: str = _f("train-only", "train-only: no engine; forge: keep the "
                                     "engine and its weight syncs", ("train-only", "forge"))
    debug_rollout_only: bool = _f(False, "generate, reward, dump (--save-rollout-data) and "
                                  "log, with no trainer and no optimizer")
    debug_train_only: bool = _f(False, "slime's train-only debugging: no engine; requires "
                                "--load-rollout-data in train-only mode, or the SFT rollout "
                                "function (which generates nothing)")
    load_rollout_data_fallback: bool = _f(False, "replay rollout 0's dump when a rollout's "
                                          "dump is missing")
    save_hf: str | None = _f(None, "write the trained weights as an HF checkpoint here, at the "
                             "end; a path with {rollout_id} (e.g. 'hf/iter_{rollout_id}') is "
                             "written every --save-hf-interval rollouts too")
    save_hf_interval: int | None = _f(None, "rollouts between HF exports of a --save-hf "
                                      "{rollout_id} template; default --save-interval")
    save_hf_max_shard_size: str = _f("5GB", "size limit of one safetensors shard")
    save_hf_dtype: str | None = _f(None, "dtype of the exported weights; default: the model "
                                   "config's torch_dtype (the trainer may compute in fp32)",
                                   SAVE_HF_DTYPES)
    save_hf_overwrite: bool = _f(False, "let --save-hf write into a non-empty directory no "
                                 "vime export wrote (only the exported files are replaced "
                                 "there; vime-only flag)")
    allow_dataset_change: bool = _f(False, "let --load resume although --prompt-data changed "
                                    "since the checkpoint (size or content; vime-only flag)")

    @property
    def save_hf_is_template(self) -> bool:
        """``--save-hf`` holds ``{rollout_id}``: one export directory per interval."""
        return self.save_hf is not None and "{rollout_id}" in self.save_hf

    def _check(self) -> None:
        at_least("save_interval", self.save_interval, 1)
        at_least("save_hf_interval", self.save_hf_interval, 1)
        if self.save_rollout_data is not None and "{rollout_id}" not in self.save_rollout_data:
            raise field_error(ConfigError, "save_rollout_data", self.save_rollout_data,
                              "lacks {rollout_id}: every rollout would overwrite one file",
                              "use e.g. 'dumps/rollout_{rollout_id}.npz'")
        if self.save_hf_interval is not None and not self.save_hf_is_template:
            raise field_error(ConfigError, "save_hf_interval", self.save_hf_interval,
                              "needs a --save-hf path with {rollout_id} (each export gets its "
                              "own directory)", "pass e.g. --save-hf 'hf/iter_{rollout_id}'")
        if self.debug_rollout_only:
            for name in ("load_rollout_data", "save", "load", "save_hf"):
                if getattr(self, name) is not None:
                    raise field_error(ConfigError, "--debug-rollout-only", True,
                                      f"builds no trainer, so --{name.replace('_', '-')} has "
                                      "nothing to act on", f"drop --{name.replace('_', '-')}")
