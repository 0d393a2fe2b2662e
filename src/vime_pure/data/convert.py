"""Samples -> ``RolloutBatch`` columns: one Python pass over the samples, then numpy.

The per-sample loop only reads attributes and does cheap type checks; when a check fails it
calls the ``vime_pure.data.rollout_output`` helper that builds the error naming the sample's path. Tokens
given as numpy arrays are concatenated; lists are chained and converted once. Converting Python
ints costs tens of ns per token, so a shell that receives lists should turn each sample's tokens
into an int32 array as it arrives (``benchmarks/batch_convert.py`` measures both).

Example: samples with ``tokens=[1, 2, 3], response_length=2`` and ``tokens=[4, 5],
response_length=1, loss_mask=[0]`` give ``tokens=[1, 2, 3, 4, 5]``, ``token_offsets=[0, 3, 5]``,
``loss_masks=[1, 1, 0]`` and ``response_offsets=[0, 2, 3]``; ``weight_versions=[3, 5]`` and
``[]`` give ``weight_version_min=[3, -1]`` and ``weight_version_max=[5, -1]`` (-1: on policy).
"""

from itertools import chain
from operator import attrgetter
from typing import Any

import numpy as np
from jaxtyping import Float32, Int32, Int64, UInt8

from vime_pure.data.columns import RESPONSE_FLOAT_COLUMNS, all_finite
from vime_pure.denominators import group_totals
from vime_pure.errors import RolloutValidationError
from vime_pure.data.ragged import offsets_from_lengths, row_positions, row_sums
from vime_pure.data.rewards import RewardNormalization, normalize_rewards, scalar_reward
from vime_pure.data.rollout_output import (FlatRollout, all_or_none, check_response_length,
                                           flatten_rollout_output, mask_values)
from vime_pure.data.routes import flat_routes
from vime_pure.data.sample import ON_POLICY_VERSION, STATUSES, as_status

_STATUS_CODE: dict[Any, int] = {s: k for k, s in enumerate(STATUSES)}  # str values hash alike
_INT32_MAX = np.iinfo(np.int32).max
_INT64_END = 2**63


def batch_columns(output: object, reward_key: str | None,
                  normalization: RewardNormalization) -> dict[str, Any]:
    """Keyword arguments of ``RolloutBatch`` for a validated rollout output."""
    flat = flatten_rollout_output(output)
    n = len(flat.samples)
    if n == 0:
        raise RolloutValidationError("output holds no samples. Fix: return at least one "
                                     "Sample; a batch with nothing to train is a rollout bug.")
    rows = _read_samples(flat, reward_key)
    lengths, response_lengths = rows["lengths"], rows["response_lengths"]
    response_offsets = offsets_from_lengths(response_lengths)
    masks = _flat_masks(flat, rows, response_offsets)
    groups, group_values = flat.group_dense, flat.group_values
    prompts, prompt_values = flat.prompt_dense, flat.prompt_values
    rewards = np.array(rows["rewards"], dtype=np.float64)
    return dict(
        tokens=_flat_tokens(flat, rows["tokens"], int(lengths.sum())),
        token_offsets=offsets_from_lengths(lengths), lengths=lengths,
        response_lengths=response_lengths, loss_masks=masks, response_offsets=response_offsets,
        **{name: _flat_floats(flat, rows[name], response_offsets, name=name)
           for name in RESPONSE_FLOAT_COLUMNS},
        group_ids=groups, group_id_values=group_values,
        prompt_groups=prompts, prompt_group_values=prompt_values,
        group_mask_sums=group_totals(groups,
                                     row_sums(masks, response_offsets).astype(np.float64)),
        rewards=rewards,
        advantages=normalize_rewards(rewards, groups, prompts, normalization,
                                     where=flat.path),
        statuses=np.array(rows["statuses"], dtype=np.uint8),
        removed=np.array(rows["removed"], dtype=np.bool_),
        sample_indices=np.array(rows["indices"], dtype=np.int64),
        **_version_bounds(flat),
        rollout_routed_experts=flat_routes([s.rollout_routed_experts for s in flat.samples],
                                           lengths, flat.path),
    )


def _version_bounds(flat: FlatRollout) -> dict[str, Int64[np.ndarray, " n"]]:
    """``weight_version_min`` / ``_max`` per sample: the first and last entries of its
    non-decreasing ``weight_versions``, ``ON_POLICY_VERSION`` for an empty list.

    Vectorised: one C-level pass over the lengths, one over the entries' types, then numpy;
    only a failing check loops over the samples to name the bad one."""
    n = len(flat.samples)
    lo = np.full(n, ON_POLICY_VERSION, dtype=np.int64)
    hi = lo.copy()
    versions = [s.weight_versions for s in flat.samples]
    try:
        lengths = np.fromiter(map(len, versions), dtype=np.int64, count=n)
    except TypeError:  # something without a length: the loop below names it
        lengths = None
    if lengths is not None and not lengths.any():  # all on policy: nothing to check
        return dict(weight_version_min=lo, weight_version_max=hi)
    if lengths is not None and all(type(v) is list for v in versions):
        entries = list(chain.from_iterable(versions))
        if set(map(type, entries)) <= {int}:
            try:
                values = np.array(entries, dtype=np.int64)
            except OverflowError:
                values = None
            offsets = offsets_from_lengths(lengths)
            inner = np.ones(len(entries), dtype=bool)
            inner[offsets[:-1][lengths > 0]] = False  # a row's first entry has no predecessor
            if values is not None and not (values < 0).any() and not (
                    np.diff(values, prepend=0) < 0)[inner].any():
                has = lengths > 0
                lo[has], hi[has] = values[offsets[:-1][has]], values[offsets[1:][has] - 1]
                return dict(weight_version_min=lo, weight_version_max=hi)
    for i, v in enumerate(versions):
        if type(v) is list and not v:
            continue
        lo[i], hi[i] = _checked_versions(v, flat.path(i))
    return dict(weight_version_min=lo, weight_version_max=hi)


def _checked_versions(versions: object, where: str) -> tuple[int, int]:
    """``(first, last)`` of a valid version list; a typed error naming the sample otherwise."""
    if not _flat_sequence(versions):
        raise RolloutValidationError(f"{where}: weight_versions={versions!r:.60} is a "
                                     f"{type(versions).__name__}, not a list. Fix: append the "
                                     "engine's weight version (an int) per generated segment.")
    values = (versions.tolist() if isinstance(versions, np.ndarray)
              else list(versions) if isinstance(versions, (list, tuple)) else [])
    for v in values:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not (
                0 <= v < _INT64_END):
            raise RolloutValidationError(f"{where}: weight_versions holds {v!r}, not a weight "
                                         "version (an int >= 0). Fix: record the engine's "
                                         "weight version, or leave the list empty (on policy).")
    if not values:
        return ON_POLICY_VERSION, ON_POLICY_VERSION
    if any(b < a for a, b in zip(values, values[1:])):
        raise RolloutValidationError(f"{where}: weight_versions={values[:8]} decreases. Fix: "
                                     "append one version per segment in generation order "
                                     "(weights only move forward).")
    return int(values[0]), int(values[-1])


def _read_samples(flat: FlatRollout, reward_key: str | None) -> dict[str, Any]:
    """Per-sample fields, read column by column with list comprehensions and checked with
    numpy; a failing check falls back to the per-sample helper that names the path."""
    ss = flat.samples
    n = len(ss)
    tokens = [s.tokens for s in ss]
    bad = next((i for i, t in enumerate(tokens) if not _flat_sequence(t)), None)
    lengths = (np.fromiter(map(len, tokens), dtype=np.int64, count=n) if bad is None
               else np.zeros(0, dtype=np.int64))  # unread: the error below names sample bad
    if bad is not None or lengths.min() < 1:
        i = bad if bad is not None else int(np.argmin(lengths))
        raise RolloutValidationError(f"{flat.path(i)}: tokens={tokens[i]!r:.60} is not a "
                                     "non-empty list of token ids. Fix: set prompt + "
                                     "response token ids.")
    resp_raw = [s.response_length for s in ss]
    resp = None
    if all(type(r) is int for r in resp_raw):
        try:
            resp = np.fromiter(resp_raw, dtype=np.int64, count=n)
        except OverflowError:  # beyond int64: the per-sample check below names it
            resp = None
    if resp is None or ((resp < 0) | (resp > lengths)).any():  # numpy ints, or an error
        resp = np.fromiter((check_response_length(s, flat.path(i)) for i, s in enumerate(ss)),
                           dtype=np.int64, count=n)
    masks = [None if s.remove_sample else s.loss_mask for s in ss]
    floats = {name: list(map(attrgetter(name), ss)) for name in RESPONSE_FLOAT_COLUMNS}
    for name, col in (("loss_mask", [s.loss_mask for s in ss]), *floats.items()):
        odd = next((i for i, m in enumerate(col) if m is not None and not _flat_sequence(m)),
                   None)
        if odd is not None:  # a str or an int would broadcast or fail inside numpy
            raise RolloutValidationError(
                f"{flat.path(odd)}: {name}={col[odd]!r:.60} is a {type(col[odd]).__name__}, "
                "not a flat list or array. Fix: give one value per response token"
                + (", or None for all ones." if name == "loss_mask" else ", or None."))
        sizes = np.fromiter((-1 if m is None else len(m) for m in col), dtype=np.int64, count=n)
        wrong = np.flatnonzero((sizes >= 0) & (sizes != resp))
        if wrong.size:
            i = int(wrong[0])
            raise RolloutValidationError(
                f"{flat.path(i)}: len({name})={int(sizes[i])} but response_length="
                f"{int(resp[i])}. Fix: give one value per response token (not per prompt + "
                "response token)" + (", or set loss_mask=None for all ones." if name ==
                                     "loss_mask" else "."))
    rewards = [s.reward for s in ss]
    if not all(type(r) is float for r in rewards):
        rewards = [r if type(r) is float else scalar_reward(r, reward_key, flat.path(i))
                   for i, r in enumerate(rewards)]
    completed, truncated, aborted = STATUSES  # identity tests: hashing a str-Enum is slow
    statuses = [0 if st is completed else 1 if st is truncated else 2 if st is aborted else
                _STATUS_CODE[as_status(st, f"{flat.path(i)}.status")]
                for i, st in enumerate(s.status for s in ss)]
    removed = [s.remove_sample for s in ss]
    odd = next((i for i, r in enumerate(removed) if type(r) is not bool), None)
    if odd is not None:
        raise RolloutValidationError(f"{flat.path(odd)}: remove_sample={removed[odd]!r} is not "
                                     "a bool. Fix: set True or False.")
    indices = [-1 if (k := s.index) is None else k if type(k) is int and 0 <= k < _INT64_END
               else _check_index(k, flat.path(i)) for i, s in enumerate(ss)]
    return dict(tokens=tokens, lengths=lengths, response_lengths=resp, masks=masks,
                rewards=rewards, statuses=statuses, removed=removed, indices=indices, **floats)


_SEQUENCES = (list, tuple, np.ndarray)


def _flat_sequence(value: object) -> bool:
    """A list, tuple or 1-D array (``len`` and concatenation mean one entry per token)."""
    if type(value) is list or type(value) is tuple:
        return True
    if isinstance(value, np.ndarray):
        return value.ndim == 1
    return isinstance(value, (list, tuple))


def _check_index(index: object, where: str) -> int:
    if isinstance(index, (bool, np.bool_)) or not isinstance(index, (int, np.integer)) or not (
            0 <= index < _INT64_END):
        raise RolloutValidationError(f"{where}: index={index!r} is not a non-negative int64. "
                                     "Fix: set an int index or None.")
    return int(index)


def _concat(parts: list, dtype: type | None = None) -> np.ndarray:
    """Flatten ragged parts (arrays, lists or tuples) with one ``concatenate``; it converts
    lists as fast as chaining them first. Non-numbers raise or give a non-numeric dtype,
    which the callers check."""
    return np.concatenate(parts, dtype=dtype) if parts else np.zeros(0, dtype=dtype)


def _flat_tokens(flat: FlatRollout, parts: list, total: int) -> Int32[np.ndarray, " t"]:
    try:
        tokens = _concat(parts)
    except (TypeError, ValueError):
        tokens = np.zeros(0, dtype=np.float64)  # fall through to the per-sample search
    if tokens.dtype.kind not in "iu" or tokens.shape != (total,):
        for i, p in enumerate(parts):
            arr = np.asarray(p, dtype=object)
            bad = [t for t in arr.ravel().tolist()
                   if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))]
            if bad or arr.ndim != 1:
                raise RolloutValidationError(
                    f"{flat.path(i)}: tokens hold {bad[0] if bad else arr.tolist()!r:.60}, not "
                    "integer token ids. Fix: store token ids as ints (detokenise nothing).")
        raise RolloutValidationError(f"tokens flatten to {tokens.dtype}{tokens.shape}, not "
                                     f"{total} integers. Fix: store token ids as flat int lists.")
    in_range = tokens.min() >= 0 and (tokens.dtype == np.int32 or tokens.max() <= _INT32_MAX)
    if not in_range:
        k = int(np.argmax((tokens < 0) | (tokens > _INT32_MAX)))
        i = int(np.searchsorted(offsets_from_lengths(np.array([len(p) for p in parts])), k,
                                side="right")) - 1
        raise RolloutValidationError(f"{flat.path(i)}: token id {int(tokens[k])} is outside "
                                     f"[0, {_INT32_MAX}]. Fix: pass the tokenizer's ids.")
    return tokens.astype(np.int32, copy=False)


def _flat_masks(flat: FlatRollout, rows: dict[str, list], offsets: np.ndarray
                ) -> UInt8[np.ndarray, " r"]:
    """All ones, explicit masks written over them, removed samples zeroed."""
    masks = np.ones(int(offsets[-1]), dtype=np.uint8)
    explicit = [i for i, m in enumerate(rows["masks"]) if m is not None]
    if explicit:
        values = _ints_or_floats([rows["masks"][i] for i in explicit])
        if values.size and (values.dtype.kind not in "biuf"
                            or ((values != 0) & (values != 1)).any()):
            for i in explicit:
                mask_values(np.asarray(rows["masks"][i]), flat.path(i))
        masks[row_positions(offsets, np.array(explicit, dtype=np.int64))] = values
    removed = np.flatnonzero(np.array(rows["removed"], dtype=np.bool_))
    if removed.size:
        masks[row_positions(offsets, removed)] = 0
    return masks


def _ints_or_floats(parts: list) -> np.ndarray:
    try:
        return _concat(parts)
    except (TypeError, ValueError):
        return np.array([], dtype=object)


def _flat_floats(flat: FlatRollout, parts: list, offsets: np.ndarray, *,
                 name: str) -> Float32[np.ndarray, " r"] | None:
    """One of the ``RESPONSE_FLOAT_COLUMNS`` (log-probs, reverse-KL estimates) over every
    response token."""
    if not all_or_none(parts, name, flat.path, f"record {name} for every sample or for none "
                       "(never silently train on a mix)"):
        return None
    try:
        values = _concat(parts, np.float32)
    except (TypeError, ValueError) as exc:
        raise RolloutValidationError(f"{name} are not all numbers ({exc}). Fix: "
                                     "store one float per response token.") from None
    if not all_finite(values):
        bad = np.flatnonzero(~np.isfinite(values))
        i = int(np.searchsorted(offsets, bad[0], side="right")) - 1
        raise RolloutValidationError(f"{flat.path(i)}: {name} holds {values[bad[0]]}. "
                                     f"Fix: {RESPONSE_FLOAT_COLUMNS[name]} must be finite.")
    return values

