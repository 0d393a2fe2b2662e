"""Evaluation (section ``eval``): the eval sets, when they run, and their sampling (each setting
defaults to its ``--rollout-*`` twin).

Example: ``EvalArgs(eval_prompt_data=["gsm8k"])`` raises ``eval_prompt_data=['gsm8k']: is not
NAME PATH pairs ...``.
"""

import attrs

from vime_pure.errors import field_error
from vime_shell.settings.common import ConfigError, Record, at_least, setting, setting_list
from vime_shell.settings.rollout import check_sampling

SECTION = "eval"


def _f(default, help):
    return setting(default, help, SECTION)


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class EvalArgs(Record):
    """Which sets are evaluated, how often, and how they are sampled."""

    eval_prompt_data: tuple[str, ...] | None = setting_list(
        "NAME PATH [NAME PATH ...] eval sets; one PATH alone is slime's legacy form, the set "
        "'aime'", SECTION)
    eval_config: str | None = _f(None, "YAML/JSON file of eval sets with their own keys: "
                                 "{datasets: [{name, path, input_key, label_key}]} (beside "
                                 "--eval-prompt-data)")
    eval_interval: int | None = _f(None, "evaluate every N rollouts (and after the last); "
                                   "default with --eval-prompt-data: before the first and "
                                   "after the last")
    eval_function_path: str | None = _f(None, "rollout function of evaluation, 'pkg.mod:fn' "
                                        "(the --rollout-function-path signature); default "
                                        "the training rollout function (miles')")
    n_samples_per_eval_prompt: int = _f(1, "samples per eval prompt (pass@k uses them)")
    eval_max_response_len: int | None = _f(None, "max new tokens in eval; default "
                                           "--rollout-max-response-len")
    eval_temperature: float | None = _f(None, "eval sampling temperature; default "
                                        "--rollout-temperature")
    skip_eval_before_train: bool = _f(False, "no evaluation before the first rollout")
    eval_top_p: float | None = _f(None, "eval nucleus mass; default --rollout-top-p")
    eval_top_k: int | None = _f(None, "eval top-k; default --rollout-top-k")
    eval_stop: tuple[str, ...] | None = setting_list("eval stop strings; default --rollout-stop",
                                                  SECTION)
    eval_stop_token_ids: tuple[int, ...] | None = setting_list(
        "eval stop token ids (besides the default ones); default --rollout-stop-token-ids",
        SECTION)
    eval_max_context_len: int | None = _f(None, "eval max prompt + response tokens; default "
                                          "--rollout-max-context-len")
    eval_input_key: str | None = _f(None, "eval rows' prompt field; default --input-key")
    eval_label_key: str | None = _f(None, "eval rows' label field; default --label-key")

    @property
    def has_evals(self) -> bool:
        return self.eval_prompt_data is not None or self.eval_config is not None

    def _check(self) -> None:
        for name in ("n_samples_per_eval_prompt", "eval_interval", "eval_max_response_len"):
            at_least(name, getattr(self, name), 1)
        check_sampling("eval", self.eval_temperature, self.eval_top_p, self.eval_top_k,
                       self.eval_max_context_len, self.eval_stop, self.eval_stop_token_ids)
        if self.eval_prompt_data is not None and len(self.eval_prompt_data) % 2:
            raise field_error(ConfigError, "eval_prompt_data", list(self.eval_prompt_data),
                              "is not NAME PATH pairs",
                              "pass e.g. --eval-prompt-data gsm8k test.jsonl aime aime.jsonl")
        if self.eval_interval is not None and not self.has_evals:
            raise field_error(ConfigError, "eval_interval", self.eval_interval,
                              "needs --eval-prompt-data",
                              "pass e.g. --eval-prompt-data gsm8k test.jsonl")
        names = list((self.eval_prompt_data or ())[::2])
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise field_error(ConfigError, "eval_prompt_data", list(self.eval_prompt_data or ()),
                              f"names the eval set(s) {twice} more than once, and each name "
                              "keys its metrics (eval/<name>/...)",
                              "give every eval set its own name")
