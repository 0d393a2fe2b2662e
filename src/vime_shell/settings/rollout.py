"""Generation (section ``rollout``): the rollout function, the batch's shape, sampling and
stop controls, dynamic sampling and partial rollouts.

Example: ``RolloutArgs(rollout_batch_size=16, n_samples_per_prompt=8).groups_per_rollout`` is
128; ``RolloutArgs(rollout_top_p=0)`` raises ``rollout_top_p=0: must be in [1e-06, 1.0] ...``.
"""

import attrs

from vime_pure.errors import field_error
from vime_pure.data.tool_calls import FORMATS
from vime_shell.agents.sessions import MATCHERS
from vime_shell.rollout.functions import (AGENT_GENERATE_FUNCTION, DEFAULT_ROLLOUT_FUNCTION,
                                          GENERATE_TIMEOUT_S, MAX_GENERATION_ROUNDS,
                                          PER_SAMPLE_ROLLOUT_FUNCTION, SFT_ROLLOUT_FUNCTION)
from vime_shell.settings.common import (ConfigError, Record, at_least, in_range, setting,
                                        setting_list)

SECTION = "rollout"


def _f(default, help, choices=None):
    return setting(default, help, SECTION, choices)


def check_sampling(prefix: str, temperature, top_p, top_k, max_context_len, stop,
                   stop_token_ids) -> None:
    """The sampling and stop knobs of ``prefix`` (``rollout`` or ``eval``): one rule each."""
    in_range(f"{prefix}_temperature", temperature, 0.0, 100.0, "use 1.0 (or 0 for greedy)")
    in_range(f"{prefix}_top_p", top_p, 1e-6, 1.0, "use 1.0")
    at_least(f"{prefix}_top_k", top_k, 0)
    at_least(f"{prefix}_max_context_len", max_context_len, 2)
    for tok in stop_token_ids or ():
        at_least(f"{prefix}_stop_token_ids", tok, 0)
    if any(not s for s in stop or ()):
        raise field_error(ConfigError, f"{prefix}_stop", list(stop),
                          "holds an empty string (it would stop at once)",
                          "drop the empty entry")


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class RolloutArgs(Record):
    """What one rollout generates, and how."""

    rollout_function_path: str = _f(DEFAULT_ROLLOUT_FUNCTION, "rollout function, 'pkg.mod:fn'")
    custom_generate_function_path: str | None = _f(
        None, "per-sample 'pkg.mod:fn', slime's async generate(args, sample, sampling_params) "
        "-> Sample | list[Sample]; it may await vime_shell.rollout.functions.generate for each "
        "turn")
    custom_agent_function_path: str | None = _f(
        None, "an agent, miles' async run_agent(base_url, prompt, request_kwargs, metadata) -> "
        "dict | None: it talks to the run's engine through base_url, an OpenAI-compatible "
        "session of vime's session server, and every leaf of its session trees (compaction, "
        "sub-agents) becomes one sample of the execution's group; the dict may carry reward, "
        "response and metadata")
    session_message_matcher: str = _f(
        "strict", "when a request's message equals a stored one, so the request continues "
        "that token path: strict (role, content, tool calls as sent back) or tool_args "
        "(tool-call arguments compared as parsed JSON)", MATCHERS)
    tito_model: str = _f("qwen", "the model family's turn format for agent sessions: its "
                         "tool-call markers and turn-end token (what the template writes "
                         "after a turn's end is read from the template)", tuple(FORMATS))
    generate_timeout: float = _f(
        GENERATE_TIMEOUT_S, "seconds one execution of the per-sample generate function "
        "(--custom-generate-function-path, or the built-in one) may take; over it the run stops "
        "with an error naming the prompt and the execution, also when the function blocks the "
        "event loop (time.sleep in the coroutine); a 'still waiting' line every 60 s meanwhile. "
        "Default 3600: longer than any single execution of a real run (a 32k-token response at "
        "30 tokens/s takes 18 min), short enough to end a stuck job (vime only: slime and miles "
        "have no such flag)")
    partial_rollout: bool = _f(False, "abort unfinished generations once a rollout has its "
                               "groups; they continue under the new weights in a later "
                               "rollout (per-sample generation). vime: the unfinished groups "
                               "are in the checkpoint; resumed without this flag they are "
                               "generated again from scratch as the next rollout's first "
                               "prompts (never lost, never trained twice). Several "
                               "engines (of one rank each) keep a buffer each and complete "
                               "their share of the batch; a resume deals the saved groups "
                               "to the engines it has. With "
                               "--fully-async: every weight sync cuts the requests in "
                               "flight and continues them on the new weights at once, one "
                               "weight version per segment; one step off: needs "
                               "--max-weight-staleness 2)")
    mask_offpolicy_in_partial_rollout: bool = _f(False, "loss mask 0 for every token of a "
                                                 "partial rollout generated under older "
                                                 "weights (vime: also of samples that finished "
                                                 "before the last sync; --fully-async: older "
                                                 "than the group's newest segment)")
    sglang_server_concurrency: int = _f(512, "requests in flight per engine in per-sample "
                                        "generation (vime: on the HF or vLLM engine)")
    rollout_num_turns: int = _f(2, "turns per execution of the compact rollout (2-3)")
    rollout_turn_reward: str = _f("mean", "compact rollout reward over turns", ("mean", "all"))
    num_rollout: int | None = _f(None, "rollout batches to generate and train on; default "
                                 "300, or what --num-epoch needs")
    rollout_batch_size: int = _f(16, "prompts (prompt groups) per rollout batch")
    n_samples_per_prompt: int = _f(8, "rollout executions per prompt")
    rollout_temperature: float = _f(1.0, "sampling temperature")
    rollout_top_p: float = _f(1.0, "nucleus sampling mass")
    rollout_top_k: int = _f(0, "top-k sampling, 0 (or slime's -1) for off")
    rollout_max_response_len: int | None = _f(None, "max new tokens; default: the built-in "
                                              "task's answer length")
    rollout_stop: tuple[str, ...] | None = setting_list(
        "stop strings: a response ends once its text contains one (the stop string stays in "
        "the response)", SECTION)
    rollout_stop_token_ids: tuple[int, ...] | None = setting_list(
        "more stop token ids; generation always stops at the tokenizer's EOS, the "
        "generation_config.json eos_token_id and, with --apply-chat-template, the template's "
        "end-of-turn token (e.g. <|im_end|>)", SECTION)
    rollout_max_context_len: int | None = _f(None, "max prompt + response tokens: a "
                                             "response's budget is the smaller of this minus "
                                             "its prompt and --rollout-max-response-len")
    over_sampling_batch_size: int | None = _f(None, "prompts drawn per generation round under "
                                              "dynamic sampling")
    dynamic_sampling_filter_path: str | None = _f(None, "keep a prompt group when "
                                                  "'pkg.mod:fn(samples)' (or slime's "
                                                  "fn(args, samples)) is true, e.g. "
                                                  "vime_shell.rollout.filters:nonzero_reward_std")
    custom_rollout_log_function_path: str | None = _f(
        None, "slime's fn(rollout_id, args, samples, metrics, seconds), called on rank 0 after "
        "each rollout's generation; vime's metrics.jsonl is written whatever it returns")
    dynamic_sampling_max_rounds: int = _f(8, "generation rounds per rollout under dynamic "
                                          "sampling before training on what passed (a rollout "
                                          "where nothing passed is logged and skipped)")
    dynamic_sampling_fill_filtered: bool = _f(False, "when fewer prompts than "
                                              "--rollout-batch-size pass within the rounds, "
                                              "fill the batch with filtered-out ones")

    @property
    def groups_per_rollout(self) -> int:
        """Rollout groups the built-in rollouts produce per batch: prompts x samples."""
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def effective_rollout_function_path(self) -> str:
        """The rollout function the loop runs: ``--rollout-function-path``, or the per-sample
        driver ``generate_rollout`` when the default is left and ``--custom-generate-function-
        path`` or ``--partial-rollout`` asks for per-sample generation."""
        if self.rollout_function_path == DEFAULT_ROLLOUT_FUNCTION and (
                self.generate_function_path is not None or self.partial_rollout):
            return PER_SAMPLE_ROLLOUT_FUNCTION
        return self.rollout_function_path

    @property
    def generate_function_path(self) -> str | None:
        """The per-sample function the user asked for: ``--custom-generate-function-path``,
        or vime's agent driver for ``--custom-agent-function-path``; None: the built-in."""
        if self.custom_agent_function_path is not None:
            return AGENT_GENERATE_FUNCTION
        return self.custom_generate_function_path

    def _check(self) -> None:
        for name in ("rollout_num_turns", "rollout_batch_size", "n_samples_per_prompt",
                     "dynamic_sampling_max_rounds", "sglang_server_concurrency",
                     "rollout_max_response_len", "over_sampling_batch_size", "num_rollout"):
            at_least(name, getattr(self, name), 1)
        if self.rollout_function_path == SFT_ROLLOUT_FUNCTION and self.n_samples_per_prompt != 1:
            raise field_error(ConfigError, "n_samples_per_prompt", self.n_samples_per_prompt,
                              f"would repeat each conversation of {SFT_ROLLOUT_FUNCTION}",
                              "pass --n-samples-per-prompt 1 (its default with that function)")
        check_sampling("rollout", self.rollout_temperature, self.rollout_top_p,
                       self.rollout_top_k, self.rollout_max_context_len, self.rollout_stop,
                       self.rollout_stop_token_ids)
        if self.dynamic_sampling_max_rounds > MAX_GENERATION_ROUNDS:
            raise field_error(ConfigError, "dynamic_sampling_max_rounds",
                              self.dynamic_sampling_max_rounds,
                              f"exceeds {MAX_GENERATION_ROUNDS}, the rounds a rollout's seed "
                              "range holds", "raise --over-sampling-batch-size instead")
        if self.rollout_num_turns > 3:
            raise field_error(ConfigError, "rollout_num_turns", self.rollout_num_turns,
                              "must be 2 or 3", "use 2 (or the single-turn rollout)")
        self._check_partial()
        self._check_agent()
        self._check_over_sampling()
        self._check_generate_timeout()

    def _check_agent(self) -> None:
        if self.custom_agent_function_path is None:
            return
        if self.custom_generate_function_path is not None:
            raise field_error(ConfigError, "custom_agent_function_path",
                              self.custom_agent_function_path,
                              "runs through vime's own per-sample function, so it excludes "
                              f"--custom-generate-function-path "
                              f"{self.custom_generate_function_path}", "pass one of them")
        if self.partial_rollout:
            raise field_error(ConfigError, "custom_agent_function_path",
                              self.custom_agent_function_path,
                              "does not run with --partial-rollout yet (a session cut at a "
                              "sync cannot be continued by the agent)",
                              "drop --partial-rollout")
        if self.rollout_function_path != DEFAULT_ROLLOUT_FUNCTION:
            raise field_error(ConfigError, "custom_agent_function_path",
                              self.custom_agent_function_path,
                              "runs in the per-sample driver, which --rollout-function-path "
                              f"{self.rollout_function_path} replaces",
                              "drop --rollout-function-path")

    def _check_over_sampling(self) -> None:
        filtered = self.dynamic_sampling_filter_path is not None
        if self.dynamic_sampling_fill_filtered and not filtered:
            raise field_error(ConfigError, "dynamic_sampling_fill_filtered", True,
                              "fills only what a dynamic-sampling filter removed",
                              "pass --dynamic-sampling-filter-path, or drop the flag")
        if self.over_sampling_batch_size is None:
            return
        if not filtered and not self.partial_rollout:
            raise field_error(ConfigError, "over_sampling_batch_size",
                              self.over_sampling_batch_size,
                              "over-samples only for a dynamic-sampling filter or a "
                              "partial rollout",
                              "pass --dynamic-sampling-filter-path or --partial-rollout, "
                              "or drop the flag")
        if self.over_sampling_batch_size < self.rollout_batch_size:
            raise field_error(ConfigError, "over_sampling_batch_size",
                              self.over_sampling_batch_size,
                              f"is below rollout_batch_size={self.rollout_batch_size}",
                              "draw at least as many prompts per round as a batch needs")

    def _check_generate_timeout(self) -> None:
        in_range("generate_timeout", self.generate_timeout, 1e-3, 1e6, "pass seconds, e.g. 600")
        if self.generate_timeout != GENERATE_TIMEOUT_S and \
                self.effective_rollout_function_path != PER_SAMPLE_ROLLOUT_FUNCTION:
            raise field_error(ConfigError, "generate_timeout", self.generate_timeout,
                              "bounds executions of a per-sample generate function, and "
                              f"--rollout-function-path {self.rollout_function_path} runs none",
                              "pass --custom-generate-function-path, or drop the flag")

    def _check_partial(self) -> None:
        if self.mask_offpolicy_in_partial_rollout and not self.partial_rollout:
            raise field_error(ConfigError, "mask_offpolicy_in_partial_rollout", True,
                              "has no effect without --partial-rollout",
                              "pass --partial-rollout, or drop the flag")
        per_sample = self.rollout_function_path in (DEFAULT_ROLLOUT_FUNCTION,
                                                    PER_SAMPLE_ROLLOUT_FUNCTION)
        if self.partial_rollout and not per_sample:
            raise field_error(ConfigError, "partial_rollout", True,
                              f"needs per-sample generation, not --rollout-function-path "
                              f"{self.rollout_function_path}",
                              "drop --rollout-function-path (or name "
                              f"{PER_SAMPLE_ROLLOUT_FUNCTION}) and pass your per-sample "
                              "function as --custom-generate-function-path")
