"""Column checks shared by the columnar records (``RolloutBatch``, ``TrainMicroBatch``).

Columns can come from a file (``vime_shell.storage.dump``), so every violation is a typed
``RolloutBatchError`` naming the column, the row and the fix, never an ``assert``.
Cross-field shapes are checked by ``@jaxtyped(typechecker=beartype)`` helpers (``shape_checker``),
because ``@jaxtyped`` does nothing on an attrs class.
"""

import functools
import re
from collections.abc import Callable

import numpy as np
from beartype import beartype
from jaxtyping import TypeCheckError, jaxtyped

from vime_pure.errors import RolloutBatchError


@functools.cache
def shape_checker(fn: Callable[..., None]) -> Callable[..., None]:
    """``@jaxtyped(typechecker=beartype)`` applied once per checker function."""
    return jaxtyped(typechecker=beartype)(fn)


def all_finite(values: np.ndarray) -> bool:
    """Usually one pass and no temporary: NaN and +-inf survive a sum. A non-finite sum can
    also be an overflow of finite values, so only then look element by element."""
    with np.errstate(over="ignore", invalid="ignore"):
        total = values.sum()
    return bool(np.isfinite(total)) or bool(np.isfinite(values).all())


# Columns with one row of several values per token (routed experts: layers x topk).
MATRIX_COLUMNS = ("rollout_routed_experts", "routed_experts")

# The optional float32 columns of one value per response token, each a ``Sample`` field of the
# same name, and what their values are (the words of their finite check): the engine's and a
# teacher server's log-probs, and top-k on-policy distillation's reverse-KL estimates (any
# finite real, not log-probs). Every layer that carries one carries them all, in this order.
RESPONSE_FLOAT_COLUMNS: dict[str, str] = {
    "rollout_log_probs": "log-probs", "teacher_log_probs": "log-probs",
    "opd_reverse_kl": "reverse-KL estimates"}


def check_dtypes(record: object, columns: dict[str, np.dtype], what: str,
                 optional: tuple[str, ...] = ("rollout_log_probs",)) -> None:
    for name, dtype in columns.items():
        col = getattr(record, name)
        if col is None and name in optional:
            continue
        ndim = 2 if name in MATRIX_COLUMNS else 1
        if not isinstance(col, np.ndarray) or col.dtype != dtype or col.ndim != ndim:
            got = (f"{col.dtype}[{','.join(map(str, col.shape))}]"
                   if isinstance(col, np.ndarray) else type(col).__name__)
            raise RolloutBatchError(f"{what}.{name} is {got}; expected a {ndim}-D {dtype} array. "
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
    first_bad(np.diff(offsets) != lengths, name, np.diff(offsets),
               f"consecutive offsets differ by {length_name}[i]")


def first_bad(bad: np.ndarray, name: str, values: np.ndarray, rule: str,
              fix: str = "rebuild the batch with RolloutBatch.from_samples, or correct the "
                         "source data") -> None:
    """Raise for the first True of ``bad`` (vectorised check, one Python branch)."""
    if bad.any():
        i = int(np.argmax(bad))
        raise RolloutBatchError(f"{name}[{i}]={values[i].item()!r} breaks the rule: {rule}. "
                                f"Fix: {fix}.")


