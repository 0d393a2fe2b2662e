"""Rollout functions: built-in single-turn and multi-turn/compact rollouts, and user ones.

A rollout function takes a :class:`RolloutContext` (engine, tokenizer, this round's prompts,
sampling parameters, reward) and returns samples nested in lists or tuples, as
:func:`vime_pure.data.rollout_output.flatten_rollout_output` accepts them; the loop validates
the output at that boundary (``RolloutBatch.from_samples``).

Per-sample generation is the other API: :func:`generate` (re-exported from
:mod:`vime_shell.rollout.generate`) is slime's ``async generate(args, sample,
sampling_params)``, one turn on the run's engine, the default of
``--custom-generate-function-path``; :func:`vime_shell.rollout.per_sample.generate_rollout` is
the batched rollout function that runs such a function for every execution.

- :func:`single_turn_rollout` (the default): ``output[p][k]`` is sample ``k`` of prompt ``p``;
  ``n_samples_per_prompt`` samples per prompt, each its own rollout group.
- :func:`compact_rollout`: ``output[p][k]`` is one *execution* of ``num_turns`` (2-3) turns, a
  compact leaf of ``num_turns`` samples sharing one ``group_id``. Turn ``t + 1`` sees only turn
  ``t``'s answer (the context is compacted to it); each turn is one training sample; every
  sibling gets the execution's reward: with ``turn_reward="all"`` the minimum of its turns'
  rewards ("all turns correct" for 0/1 rewards), with ``"mean"`` (default) their mean. From
  scratch, "all" never starts learning reverse2 (two 2-token answers right by chance: ~1/361^2
  per execution; 0.000 after 400 rollouts), while "mean" gives partial credit and learns
  (embedded model, 16 prompts x 8 executions x 2 turns: 0.00 -> 0.75 in ~250 rollouts).

Sharded over several engines (:mod:`vime_shell.engines.group`) each engine runs the rollout
function on :func:`share_context` of every chunk of prompts it claims from the work queue (or
its one contiguous block under ``--partial-rollout``), with ``prompt_offset`` = the global index
of the chunk's first prompt. The built-in rollouts number requests and group ids from the global prompt
index (group id ``first_group_id + r`` for request ``r``), leave prompt groups to the merged
output's top-level index, and seed request ``r`` of turn ``t`` with ``sampling.seed + t *
TURN_SEED_STRIDE + r``, so the merged output equals a single engine's whatever the split.

Invariants the tests assert: ``tokens == prompt_ids + response_ids``; ``response_length``,
``loss_mask`` and ``rollout_log_probs`` all have one entry per response token; group ids are
unique per execution (numbered from ``ctx.first_group_id``) and siblings share theirs; the
prompt group is the top-level index of the output; metadata holds the dataset row's metadata
plus ``prompt``, ``response``, ``label`` and ``turn``; the same context gives the same samples
(seeds derive from ``(seed, rollout_id)`` and the round).
"""

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from vime_pure.errors import field_error, one_line
from vime_pure.data.sample import Sample
from vime_shell.engines.base import Generation, RolloutEngine, SamplingParams
# generate: re-exported, the default of --custom-generate-function-path
from vime_shell.rollout.generate import FINISH_STATUS, generate  # noqa: F401
from vime_shell.rollout.plugins import DeadlineExpired, load_callable, run_within
from vime_shell.rollout.rewards import Rewarder
from vime_shell.rollout.tasks import DigitTask, TaskError, TaskExample

RolloutFn = Callable[["RolloutContext"], Sequence[Any]]
DEFAULT_ROLLOUT_FUNCTION = "vime_shell.rollout.functions:single_turn_rollout"
PER_SAMPLE_ROLLOUT_FUNCTION = "vime_shell.rollout.per_sample:generate_rollout"
SFT_ROLLOUT_FUNCTION = "vime_shell.rollout.sft:sft_rollout"  # conversations, no generation
DEFAULT_GENERATE_FUNCTION = "vime_shell.rollout.functions:generate"
# --custom-agent-function-path's executions (vime_shell.agents.agent)
AGENT_GENERATE_FUNCTION = "vime_shell.agents.agent:generate"
# --generate-timeout's default, seconds per execution of a per-sample generate function: an
# hour is longer than any single execution of a real run we know of (a 32k-token response at 30
# tokens/s takes 18 min), and still ends a stuck job.
GENERATE_TIMEOUT_S = 3600.0
TURN_REWARDS: tuple[str, ...] = ("mean", "all")
# A chat template renders in milliseconds; one with runaway loops is stopped after this long.
CHAT_TEMPLATE_TIMEOUT_S = 10.0
# Request seeds of one rollout, 2**24 of them from its base: generation round k (dynamic
# sampling) at base + k * 2**20, turn t of a round at + t * 2**18, request r at + r. Offsets
# depend on global indices only (not on how many requests an engine holds), and no two
# (round, turn, request) share a seed while rounds <= 16, turns <= 3 and requests < 2**18.
_SEED_STRIDE = 1 << 24
ROUND_SEED_STRIDE = 1 << 20
MAX_GENERATION_ROUNDS = _SEED_STRIDE // ROUND_SEED_STRIDE
TURN_SEED_STRIDE = 1 << 18


def rollout_sampling_seed(seed: int, rollout_id: int, generation_round: int = 0) -> int:
    """Base sampling seed of round ``generation_round`` of rollout ``rollout_id``; request
    ``r`` of turn ``t`` uses base + t * 2**18 + r.

    Example: ``rollout_sampling_seed(0, 3) == 3 * 2**24``, its round 1 ``3 * 2**24 + 2**20``.
    """
    if not 0 <= generation_round < MAX_GENERATION_ROUNDS:
        raise field_error(TaskError, "generation_round", generation_round,
                          f"is outside [0, {MAX_GENERATION_ROUNDS})",
                          f"use --dynamic-sampling-max-rounds {MAX_GENERATION_ROUNDS} or less")
    return ((seed * 1_000_003 + rollout_id) * _SEED_STRIDE
            + generation_round * ROUND_SEED_STRIDE) % (1 << 62)


@attrs.frozen(kw_only=True)
class RolloutContext:
    """Everything a rollout function needs for one generation round of a rollout batch.

    ``prompts``: this round's examples (text or chat messages, label, metadata, tools);
    ``apply_chat_template``: render prompts with the tokenizer's chat template
    (``encode_prompt``); ``rewarder``: the run's reward (``Rewarder.score(samples of one
    prompt)``); ``first_group_id``: the first group id this round may use (dynamic sampling
    runs several rounds per batch, and group ids must stay unique across them); ``task``: the
    built-in task when prompts come from one (multi-turn ``compact_rollout`` needs it).
    ``sampling.seed`` is the round's base seed (see :func:`rollout_sampling_seed`).
    Example: 16 ``prompts`` with ``n_samples_per_prompt=8`` give 128 single-turn samples.
    ``prompt_offset`` is the global index of ``prompts[0]`` (non-zero on all engines but the
    first, see :func:`share_context`). ``per_sample``: how per-sample ``generate`` functions
    run (a :class:`vime_shell.rollout.per_sample.PerSample`, for ``generate_rollout``);
    ``target_groups``: under ``--partial-rollout``, the prompt groups this round needs (the
    rest is aborted once they are done). ``loss_mask_type``: ``sft_rollout``'s
    (``--loss-mask-type``).
    """

    rollout_id: int
    engine: RolloutEngine
    tokenizer: Any
    prompts: tuple[TaskExample, ...]
    n_samples_per_prompt: int
    sampling: SamplingParams
    rewarder: Rewarder
    apply_chat_template: bool = False
    first_group_id: int = 0
    task: DigitTask | None = None
    num_turns: int = 2
    turn_reward: str = "mean"
    prompt_offset: int = 0
    per_sample: Any = None
    target_groups: int | None = None
    loss_mask_type: str | None = None


def share_context(ctx: RolloutContext, share: range) -> RolloutContext:
    """``ctx`` restricted to the prompts ``share`` (global indices, a contiguous range: a
    work-queue chunk or an engine's block).

    Example: ``share_context(ctx, range(8, 16))`` holds prompts 8-15 with ``prompt_offset=8``.
    """
    if share.step != 1 or share.start < 0 or share.stop > len(ctx.prompts):
        raise field_error(TaskError, "share", share,
                          f"is not a contiguous block of the {len(ctx.prompts)} prompts",
                          "pass a range EngineGroup.run_local / run_shares hands produce")
    return attrs.evolve(ctx, prompts=ctx.prompts[share.start:share.stop],
                        prompt_offset=ctx.prompt_offset + share.start)


def first_request(ctx: RolloutContext, num_requests: int) -> int:
    """Global index of this context's first request (per turn), checked against the stride."""
    first = ctx.prompt_offset * ctx.n_samples_per_prompt
    if first + num_requests > TURN_SEED_STRIDE:
        raise field_error(TaskError, "requests per turn", first + num_requests,
                          f"exceed {TURN_SEED_STRIDE}, the seed stride of one turn",
                          "use fewer prompts x samples per rollout")
    return first


def encode_prompt(tokenizer: Any, example: TaskExample, apply_chat_template: bool) -> list[int]:
    """Prompt token ids: the text as is, or rendered by the tokenizer's own chat template.

    Example: with a Qwen-style template, ``"1+1="`` becomes ``<|im_start|>user\n1+1=
    <|im_end|>\n<|im_start|>assistant\n`` before tokenization.
    """
    prompt = example.prompt
    if apply_chat_template:
        prompt = render_chat_template(tokenizer, example)
    elif not isinstance(prompt, str):
        raise field_error(TaskError, "prompt", f"<{len(prompt)} chat messages>",
                          "needs a chat template to become tokens",
                          "pass --apply-chat-template, or store prompts as text")
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def render_chat_template(tokenizer: Any, example: TaskExample,
                         timeout: float | None = None) -> str:
    """The prompt rendered by the tokenizer's chat template, within ``timeout`` seconds
    (default ``CHAT_TEMPLATE_TIMEOUT_S``): a template's loops can run for hours, and a
    template error is a :class:`TaskError`, not a jinja traceback."""
    prompt = example.prompt
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    limit = CHAT_TEMPLATE_TIMEOUT_S if timeout is None else timeout
    try:
        return run_within(limit, lambda: tokenizer.apply_chat_template(
            messages, tools=example.tools, tokenize=False, add_generation_prompt=True))
    except DeadlineExpired:
        problem = f"did not render within {limit:g} s"
    except Exception as exc:  # noqa: BLE001 - the template's own error, as one line
        problem = f"failed ({type(exc).__name__}: {one_line(str(exc)).rstrip('. ')})"
    raise TaskError(f"the chat template {problem} for the prompt {one_line(repr(prompt))}. "
                    "Fix: correct the tokenizer's chat_template, or drop "
                    "--apply-chat-template.")


def _respond(ctx: RolloutContext, examples: Sequence[TaskExample],
             seed_offset: int) -> list[tuple[list[int], Generation, str]]:
    """Generate one response per example: ``(prompt_ids, generation, response_text)``."""
    ids = [encode_prompt(ctx.tokenizer, e, ctx.apply_chat_template) for e in examples]
    params = ctx.sampling
    if params.seed is not None:
        params = attrs.evolve(params, seed=params.seed + seed_offset)
    gens = ctx.engine.generate(ids, params)
    texts = [ctx.tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in gens]
    return list(zip(ids, gens, texts))


def _sample(prompt_ids: list[int], gen: Generation, text: str, example: TaskExample, *,
            group_id: int, index: int, turn: int) -> Sample:
    n = len(gen.token_ids)
    return Sample(
        tokens=list(prompt_ids) + list(gen.token_ids), response_length=n, loss_mask=[1] * n,
        status=FINISH_STATUS[gen.finish_reason], group_id=group_id, index=index,
        rollout_log_probs=list(gen.log_probs), rollout_routed_experts=gen.routed_experts,
        token_versions=None if gen.token_versions is None else list(gen.token_versions),
        rollout_top_log_probs=gen.top_pairs(),
        metadata={**example.metadata, "prompt": example.prompt, "response": text,
                  "label": example.label, "turn": turn},
    )


def single_turn_rollout(ctx: RolloutContext) -> list[list[Sample]]:
    """``n_samples_per_prompt`` independent samples per prompt, rewarded per prompt.

    ``output[p]`` are prompt ``p``'s samples (its prompt group); each sample is its own
    rollout group, numbered from ``ctx.first_group_id``.
    """
    n = ctx.n_samples_per_prompt
    examples = [e for e in ctx.prompts for _ in range(n)]
    first = first_request(ctx, len(examples))
    out: list[list[Sample]] = [[] for _ in ctx.prompts]
    for j, (ids, gen, text) in enumerate(_respond(ctx, examples, first)):
        r = first + j  # the request's global index: its group id and seed offset
        out[j // n].append(_sample(ids, gen, text, examples[j],
                                   group_id=ctx.first_group_id + r, index=r, turn=0))
    rewards = ctx.rewarder.score_groups(out, lambda p: f"prompt {ctx.prompt_offset + p}")
    for samples, values in zip(out, rewards):
        for s, reward in zip(samples, values):
            s.reward = reward
    return out


def compact_rollout(ctx: RolloutContext) -> list[list[list[Sample]]]:
    """``n_samples_per_prompt`` executions of ``num_turns`` chained turns per prompt.

    Example: reverse2 with 2 turns: turn 0 ``"47>"`` -> ``"74"``, turn 1 sees only ``"74>"``
    and must answer ``"47"`` (see ``DigitTask.next_turn``); both samples share a group id;
    with ``turn_reward="all"`` both get 1.0 iff both turns are right, with ``"mean"`` they get
    0.5 when one turn is right. Needs a chainable built-in task and a per-sample reward.
    """
    if not 2 <= ctx.num_turns <= 3:
        raise field_error(TaskError, "num_turns", ctx.num_turns, "must be 2 or 3",
                          "use single_turn_rollout for one turn")
    if ctx.turn_reward not in TURN_REWARDS:
        raise field_error(TaskError, "turn_reward", ctx.turn_reward, "is not a turn reward",
                          f"use one of {TURN_REWARDS}")
    if ctx.task is None or not ctx.task.chainable:
        raise field_error(TaskError, "task", None if ctx.task is None else ctx.task.name,
                          "cannot chain turns", "use --task reverse2 or copy2 (no --prompt-data) "
                          "with compact_rollout")
    n = ctx.n_samples_per_prompt
    examples = [e for e in ctx.prompts for _ in range(n)]
    first = first_request(ctx, len(examples))
    turns: list[list[Sample]] = [[] for _ in examples]
    for t in range(ctx.num_turns):
        for j, (ids, gen, text) in enumerate(_respond(ctx, examples,
                                                      t * TURN_SEED_STRIDE + first)):
            r = first + j
            turns[j].append(_sample(ids, gen, text, examples[j], group_id=ctx.first_group_id + r,
                                    index=r * ctx.num_turns + t, turn=t))
        # Compaction: the next turn's context is this turn's answer alone.
        examples = [ctx.task.next_turn(turns[j][-1].metadata["response"], examples[j])
                    for j in range(len(turns))]
    out: list[list[list[Sample]]] = [[] for _ in ctx.prompts]
    for j, siblings in enumerate(turns):
        rewards = ctx.rewarder.score(siblings, where=f"execution {first + j}")
        reward = min(rewards) if ctx.turn_reward == "all" else sum(rewards) / len(rewards)
        for s in siblings:
            s.reward = reward
        out[j // n].append(siblings)
    return out


def load_rollout_function(path: str | None, *, flag: str = "--rollout-function-path"
                          ) -> RolloutFn:
    """``--rollout-function-path`` (or ``--eval-function-path``): the user's ``fn(ctx)``, or
    :func:`single_turn_rollout`."""
    return load_callable(path or DEFAULT_ROLLOUT_FUNCTION, flag=flag)
