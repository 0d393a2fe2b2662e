"""Prompt shares of several rollout engines, and the merge of their outputs in prompt order.

Engines claim a round's prompts in chunks from a work queue (``vime_pure.data.work_queue``);
under ``--partial-rollout`` each one generates a contiguous block of the rollout's ``P``
prompts instead: ``prompt_shares(P, E)`` gives the blocks (sizes differ by at most one, earlier
engines get the extra prompt). A prompt's ``n`` samples are requests of the same engine, so a rollout group
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

from vime_pure.data.sample import Sample
from vime_pure.errors import RolloutValidationError, field_error


def prompt_shares(num_prompts: int, num_engines: int) -> tuple[range, ...]:
    """Contiguous, balanced blocks of prompt indices, one per engine (some may be empty)."""
    for name, value, lo in (("num_prompts", num_prompts, 0), ("num_engines", num_engines, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise field_error(RolloutValidationError, name, value, f"must be an integer >= {lo}",
                              "pass the rollout's prompt count and the engine count")
    base, extra = divmod(num_prompts, num_engines)
    bounds = [e * base + min(e, extra) for e in range(num_engines + 1)]
    return tuple(range(bounds[e], bounds[e + 1]) for e in range(num_engines))


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
