"""Prompt shares of several rollout engines, and the merge of their outputs in prompt order.

Engines claim a round's prompts in chunks from a work queue (``vime_pure.data.work_queue``);
under ``--partial-rollout`` each one generates a contiguous block instead, after the groups
its own buffer carried over: ``partial_shares`` gives each engine its new prompts, its target
and its place, from ``prompt_shares(P, E)`` (sizes differ by at most one, earlier engines get
the extra prompt), and ``deal_groups`` hands a checkpoint's buffered groups to the engines of
the resumed run. With a dynamic-sampling filter each engine judges the groups it holds and
only their ``GroupVerdict`` travels; ``cut_rounds`` decides the batch from them as a judge
over the whole output would. A prompt's ``n`` samples are requests of the same engine, so a rollout group
(all samples of one execution) and a prompt group never straddle two engines.

``merge_rollout_shares(parts)`` concatenates the engines' blocks (or their chunks, put in prompt
order by ``work_queue.in_prompt_order``): nested outputs (the format of
:mod:`vime_pure.data.rollout_output`) in prompt order. Ids a rollout function left ``None`` are
numbered after the merge, so they never collide. Explicit ids (``group_id``, ``prompt_group``)
must already be unique across parts: the built-in rollouts derive them from the global prompt
index; two parts using one id would merge two rollout groups (or two prompts' advantage
baselines) silently, so that is an error naming both parts.

Invariants the tests assert: the shares partition ``range(P)`` in order; ``merge`` of the
shares of one output equals that output; a collision is a ``RolloutValidationError``.

Example: ``prompt_shares(10, 4) == (range(0, 3), range(3, 6), range(6, 8), range(8, 10))``.
"""

from collections.abc import Hashable, Sequence
from typing import TypeVar

import attrs

from vime_pure.data.sample import Sample
from vime_pure.errors import RolloutValidationError, field_error

G = TypeVar("G")  # a buffered group, whatever the shell keeps in it


def prompt_shares(num_prompts: int, num_engines: int) -> tuple[range, ...]:
    """Contiguous, balanced blocks of prompt indices, one per engine (some may be empty)."""
    for name, value, lo in (("num_prompts", num_prompts, 0), ("num_engines", num_engines, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise field_error(RolloutValidationError, name, value, f"must be an integer >= {lo}",
                              "pass the rollout's prompt count and the engine count")
    base, extra = divmod(num_prompts, num_engines)
    bounds = [e * base + min(e, extra) for e in range(num_engines + 1)]
    return tuple(range(bounds[e], bounds[e + 1]) for e in range(num_engines))


@attrs.frozen
class PartialShare:
    """One engine's part of a ``--partial-rollout`` round: the round's new prompts it starts
    (``new``, global indices of the prompts drawn for the round), the prompt groups it completes
    (``target``; the rest wait in its buffer) and where its output sits in the round's order
    (``slot``: its first place, distinct per engine even when it starts no new prompt)."""

    new: range
    target: int
    slot: int


def partial_shares(buffered: Sequence[int], per_round: int, need: int
                   ) -> tuple[PartialShare, ...]:
    """Each engine's ``PartialShare`` of a round that needs ``need`` prompt groups from
    ``per_round`` generated (``--over-sampling-batch-size``), engine ``e`` holding
    ``buffered[e]`` unfinished groups from earlier rounds (they come back first, on the engine
    that holds them). Engine ``e`` has ``prompt_shares(per_round, E)[e]`` places: its buffered
    groups, then new prompts up to that size; it completes ``prompt_shares(need, E)[e]`` groups.
    Every engine can reach its target (its places hold at least as many groups), the targets
    add up to ``need``, and the new prompts are one contiguous draw, so the batch depends only
    on the buffered counts. With one engine: ``per_round - buffered`` new prompts, target
    ``need`` (the single buffer's rule).

    Example: ``partial_shares([2, 0], 8, 6)``: engine 0 starts 2 new prompts (``range(0, 2)``)
    and completes 3, engine 1 starts 4 (``range(2, 6)``) and completes 3; slots 0 and 4."""
    if isinstance(need, bool) or not isinstance(need, int) or not 0 <= need <= per_round:
        raise field_error(RolloutValidationError, "need", need,
                          f"must be an integer in [0, per_round={per_round}]",
                          "pass the groups the round still needs, at most the round's size")
    if not buffered or any(isinstance(b, bool) or not isinstance(b, int) or b < 0
                           for b in buffered):
        raise field_error(RolloutValidationError, "buffered", list(buffered),
                          "must be one count >= 0 per engine",
                          "pass each engine's buffered group count")
    places = prompt_shares(per_round, len(buffered))
    targets = prompt_shares(need, len(buffered))
    out, first = [], 0
    for place, target, held in zip(places, targets, buffered):
        new = max(len(place) - held, 0)
        out.append(PartialShare(new=range(first, first + new), target=len(target),
                                slot=place.start))
        first += new
    return tuple(out)


def deal_groups(held: Sequence[Sequence[G]], num_engines: int) -> list[list[G]]:
    """Buffered groups of a checkpoint (``held[e]``: engine ``e``'s, in its order) for a run
    of ``num_engines`` engines: each engine its own when the count is the same, else every
    group in turn, dealt round robin (each continues on whichever engine takes it: a group's
    samples carry their tokens and versions). Example: ``deal_groups([[a, b, c]], 2) == [[a,
    c], [b]]``."""
    if len(held) == num_engines:
        return [list(h) for h in held]
    flat = [g for h in held for g in h]
    return [flat[e::num_engines] for e in range(num_engines)]


@attrs.frozen
class GroupVerdict:
    """A leader's word on one prompt group of a dynamic-sampling round: its place ``key`` =
    ``(round, prompt)``, whether the filter kept it, one past its largest int group id (the
    next round's ids start after it), and, dropped, its rollout groups' rewards (for
    ``filtered_reward_mean``)."""

    key: tuple[int, int]
    kept: bool
    next_group: int
    rewards: tuple[float, ...] = ()


@attrs.frozen
class RoundsCut:
    """A rollout's groups in batch order (``keys``: the first ``need`` kept, in round and
    prompt order, then the filled ones), and what the whole batch's judge counts: groups the
    filter dropped before the cut (``filtered``), those filled back (``filled``), the dropped
    ones' rewards."""

    keys: tuple[tuple[int, int], ...]
    filtered: int
    filled: int
    filtered_rewards: tuple[float, ...]


def cut_rounds(verdicts: Sequence[GroupVerdict], need: int, *, fill: bool) -> RoundsCut:
    """The batch of ``need`` prompt groups from every leader's verdicts (any order), decided as
    a judge over the whole output decides it: groups are judged in round and prompt order
    until ``need`` are kept (the rest of that round is discarded unjudged), and with ``fill``
    (``--dynamic-sampling-fill-filtered``) the first dropped ones fill what is missing.
    Example: verdicts at prompts 0-3 kept, dropped, kept, kept with ``need = 2``: keys of
    prompts 0 and 2, 1 filtered, prompt 3 discarded."""
    kept: list[GroupVerdict] = []
    dropped: list[GroupVerdict] = []
    for v in sorted(verdicts, key=lambda v: v.key):
        if len(kept) == need:
            break
        (kept if v.kept else dropped).append(v)
    filled = dropped[:need - len(kept)] if fill else []
    return RoundsCut(keys=tuple(v.key for v in (*kept, *filled)), filtered=len(dropped),
                     filled=len(filled),
                     filtered_rewards=tuple(r for v in dropped for r in v.rewards))


def _explicit_ids(node: object, found: dict[str, set]) -> None:
    """Collect the hashable non-None ``group_id`` / ``prompt_group`` values of an output (an
    unhashable id is reported by ``flatten_rollout_output`` after the merge)."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, Sample):
            for field in ("group_id", "prompt_group"):
                value = getattr(item, field)
                if value is not None and isinstance(value, Hashable):
                    found[field].add(value)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def merge_rollout_shares(parts: Sequence[object]) -> list:
    """The engines' outputs (engine order = prompt order) as one rollout output.

    ``parts[e]`` is engine ``e``'s output for its prompt share, any nesting
    :func:`vime_pure.data.rollout_output.flatten_rollout_output` accepts (top level: one entry
    per prompt for the built-in rollouts). Example: ``[[[a0, a1]], [[b0, b1], [c0, c1]]]``
    (engine 0: one prompt, engine 1: two) -> ``[[a0, a1], [b0, b1], [c0, c1]]``.
    """
    owner: dict[tuple[str, object], int] = {}
    merged: list = []
    for e, part in enumerate(parts):
        if isinstance(part, Sample) or not isinstance(part, (list, tuple)):
            raise field_error(RolloutValidationError, f"engine {e} output", type(part).__name__,
                              "is not a list or tuple of samples",
                              "return one list of samples per prompt from the rollout function")
        found: dict[str, set] = {"group_id": set(), "prompt_group": set()}
        _explicit_ids(part, found)
        for field, values in found.items():
            for value in values:
                first = owner.setdefault((field, value), e)
                if first != e:
                    raise field_error(
                        RolloutValidationError, field, value,
                        f"is used by two parts of the output (engines' prompt chunks {first} "
                        f"and {e}, in prompt order); merged, two rollout groups (or prompts) "
                        "would become one",
                        "derive explicit ids from the global prompt index "
                        "(RolloutContext.prompt_offset, as the built-in rollouts do) or leave "
                        "them None so they are numbered after the merge")
        merged.extend(part)
    return merged
