"""Construction-time checks of ``RolloutBatch`` (the invariants listed in ``vime_pure.batch``).

Columns can come from a file (``vime_shell.dump``), so every violation is a typed
``RolloutBatchError`` naming the column, the sample and the fix, never an ``assert``.
Cross-field shapes are checked by a ``@jaxtyped(typechecker=beartype)`` helper, because
``@jaxtyped`` does nothing on an attrs class.
"""

import functools
import re
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import numpy as np
from jaxtyping import Bool, Float32, Float64, Int32, Int64, TypeCheckError, UInt8

from vime_pure.denominators import group_totals
from vime_pure.errors import RolloutBatchError
from vime_pure.ragged import row_sums
from vime_pure.sample import STATUSES

if TYPE_CHECKING:
    from vime_pure.batch import RolloutBatch


def check_batch(b: "RolloutBatch") -> None:
    from vime_pure.batch import COLUMNS

    check_dtypes(b, COLUMNS, "RolloutBatch")
    try:
        shape_checker(_shapes)(
            b.lengths, b.token_offsets, b.response_lengths, b.response_offsets, b.tokens,
            b.rollout_log_probs, b.loss_masks, b.group_ids, b.prompt_groups,
            b.group_mask_sums, b.rewards, b.advantages, b.statuses, b.removed, b.sample_indices)
    except TypeCheckError as exc:
        raise shape_error("RolloutBatch", b, exc) from None
    _first_bad(b.lengths < 1, "lengths", b.lengths, "every sample needs at least one token")
    _first_bad((b.response_lengths < 0) | (b.response_lengths > b.lengths), "response_lengths",
               b.response_lengths, "must lie in [0, lengths[i]]")
    check_offsets("token_offsets", b.token_offsets, b.lengths, "tokens", len(b.tokens),
                  "lengths")
    check_offsets("response_offsets", b.response_offsets, b.response_lengths, "loss_masks",
                  len(b.loss_masks), "response_lengths")
    # Per-token columns are large: one reduction each, the locating pass only on failure.
    if b.tokens.size and b.tokens.min() < 0:
        _first_bad(b.tokens < 0, "tokens", b.tokens, "token ids are non-negative")
    if b.loss_masks.size and b.loss_masks.max() > 1:
        _first_bad(b.loss_masks > 1, "loss_masks", b.loss_masks, "masks are 0/1")
    mask_sums = row_sums(b.loss_masks, b.response_offsets)
    _first_bad(b.removed & (mask_sums > 0), "loss_masks of removed sample", mask_sums,
               "remove_sample zeroes the mask")
    if b.rollout_log_probs is not None and not all_finite(b.rollout_log_probs):
        _first_bad(~np.isfinite(b.rollout_log_probs), "rollout_log_probs", b.rollout_log_probs,
                   "log-probs are finite")
    _check_dense("group_ids", b.group_ids, b.group_id_values)
    _check_dense("prompt_groups", b.prompt_groups, b.prompt_group_values)
    first = np.unique(b.group_ids, return_index=True)[1]
    _first_bad(b.prompt_groups != b.prompt_groups[first][b.group_ids], "prompt_groups",
               b.prompt_groups, "a rollout group answers one prompt")
    expected = group_totals(b.group_ids, mask_sums.astype(np.float64))
    _first_bad(b.group_mask_sums != expected, "group_mask_sums", b.group_mask_sums,
               f"must equal the group's loss-mask total (here {expected.tolist()[:4]}...)")
    for name in ("rewards", "advantages"):
        col = getattr(b, name)
        _first_bad(~np.isfinite(col), name, col, "must be finite")
        _first_bad(col != col[first][b.group_ids], name, col, "siblings share one value")
    _first_bad(b.statuses >= len(STATUSES), "statuses", b.statuses,
               f"codes index {[s.value for s in STATUSES]}")
    _first_bad(b.sample_indices < -1, "sample_indices", b.sample_indices, "-1 means unknown")


@functools.cache
def shape_checker(fn: Callable[..., None]) -> Callable[..., None]:
    """``@jaxtyped(typechecker=beartype)`` applied on first use, so importing vime_pure does
    not import beartype (about 0.3 s); the checks themselves run on every construction."""
    from beartype import beartype
    from jaxtyping import jaxtyped

    return jaxtyped(typechecker=beartype)(fn)


def all_finite(values: np.ndarray) -> bool:
    """Usually one pass and no temporary: NaN and +-inf survive a sum. A non-finite sum can
    also be an overflow of finite values, so only then look element by element."""
    with np.errstate(over="ignore", invalid="ignore"):
        total = values.sum()
    return bool(np.isfinite(total)) or bool(np.isfinite(values).all())


def check_dtypes(record: object, columns: dict[str, np.dtype], what: str) -> None:
    for name, dtype in columns.items():
        col = getattr(record, name)
        if col is None and name == "rollout_log_probs":
            continue
        if not isinstance(col, np.ndarray) or col.dtype != dtype or col.ndim != 1:
            got = (f"{col.dtype}[{','.join(map(str, col.shape))}]"
                   if isinstance(col, np.ndarray) else type(col).__name__)
            raise RolloutBatchError(f"{what}.{name} is {got}; expected a 1-D {dtype} array. "
                                    f"Fix: build it with {what} helpers or cast with "
                                    f".astype(np.{dtype})")


def shape_error(what: str, record: object, exc: TypeCheckError) -> RolloutBatchError:
    """Turn jaxtyping's report into one line naming the column, its shape and the axis sizes."""
    text = str(exc)
    found = re.search(r"parameter '(\w+)'", text)
    name = found.group(1) if found else "?"
    col = getattr(record, name, None)
    shape = col.shape if isinstance(col, np.ndarray) else None
    axes = ", ".join(re.findall(r"^(\w+=\d+)$", text, flags=re.M))
    return RolloutBatchError(f"{what}.{name} has shape {shape}, which disagrees with the other "
                             f"columns ({axes}). Fix: give every per-sample column n entries, "
                             "offsets n+1 entries, masks and log-probs one per response token.")


def check_offsets(name: str, offsets: np.ndarray, lengths: np.ndarray, flat_name: str,
                  flat_len: int, length_name: str) -> None:
    if offsets[0] != 0 or offsets[-1] != flat_len:
        raise RolloutBatchError(f"{flat_name} has {flat_len} entries but {name} run from "
                                f"{int(offsets[0])} to {int(offsets[-1])} (the sum of "
                                f"{length_name}). Fix: give each sample exactly "
                                f"{length_name}[i] entries in {flat_name}.")
    _first_bad(np.diff(offsets) != lengths, name, np.diff(offsets),
               f"consecutive offsets differ by {length_name}[i]")


def _first_bad(bad: np.ndarray, name: str, values: np.ndarray, rule: str) -> None:
    """Raise for the first True of ``bad`` (vectorised check, one Python branch)."""
    if bad.any():
        i = int(np.argmax(bad))
        raise RolloutBatchError(f"{name}[{i}]={values[i].item()!r} breaks the rule: {rule}. "
                                "Fix: rebuild the batch with RolloutBatch.from_samples, or "
                                "correct the source data.")


def _check_dense(name: str, ids: np.ndarray, values: tuple[Hashable, ...]) -> None:
    bad = [v for v in values if type(v) not in (int, str)]
    if bad or len(set(values)) != len(values):
        raise RolloutBatchError(f"{name} original values {list(values)[:8]} must be distinct "
                                "ints or strs. Fix: use unique int/str ids.")
    uniq, first = np.unique(ids, return_index=True)
    if not np.array_equal(uniq, np.arange(len(values))) or np.any(np.diff(first) <= 0):
        raise RolloutBatchError(f"{name} must number {len(values)} groups 0..{len(values) - 1} "
                                f"in first-occurrence order, got {ids[:8].tolist()}... Fix: "
                                "densify with vime_pure.grouping.group_samples.")


def _shapes(lengths: Int64[np.ndarray, " n"], token_offsets: Int64[np.ndarray, " n+1"],
            response_lengths: Int64[np.ndarray, " n"],
            response_offsets: Int64[np.ndarray, " n+1"], tokens: Int32[np.ndarray, " t"],
            rollout_log_probs: Float32[np.ndarray, " r"] | None,
            loss_masks: UInt8[np.ndarray, " r"],
            group_ids: Int64[np.ndarray, " n"], prompt_groups: Int64[np.ndarray, " n"],
            group_mask_sums: Float64[np.ndarray, " n"], rewards: Float64[np.ndarray, " n"],
            advantages: Float64[np.ndarray, " n"], statuses: UInt8[np.ndarray, " n"],
            removed: Bool[np.ndarray, " n"], sample_indices: Int64[np.ndarray, " n"]) -> None:
    """Cross-field shapes: per-sample columns n, offsets n+1, masks and log-probs alike."""
