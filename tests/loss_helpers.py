"""Shared test helpers for loss accounting: a step record, an independent oracle, the Megatron
emulation of a split step, and the ``assert_*_invariants`` helpers of the core objects.

The oracle evaluates each mode's formula group by group with plain loops, sharing no code with
``vime_pure.torch_ops.loss`` beyond the mode names, so agreement is evidence rather than tautology.
"""

import math
from dataclasses import dataclass, field

import torch

from vime_pure import LossMode, Metric, sample_denominators, step_divisor
from vime_pure.cp import ZigzagOffsets, zigzag_offsets
from vime_pure.denominators import megatron_loss_scale
from vime_pure.torch_ops.cp import slice_packed_response
from vime_pure.torch_ops.loss import microbatch_loss, sample_index_from_lengths


@dataclass
class Step:
    """One optimizer step: samples with group ids, prompt/response lengths and masks."""

    group_ids: list[int]
    prompt_lengths: list[int]
    loss_masks: list[list[float]]  # one per sample, length = response length
    rejection: list[list[float]] | None = None  # 1 keep / 0 rejected, per response token
    norm: float = 8.0
    offsets: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.offsets = [0]
        for m in self.loss_masks:
            self.offsets.append(self.offsets[-1] + len(m))

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    @property
    def num_groups(self) -> int:
        return len(set(self.group_ids))

    def total_length(self, i: int) -> int:
        return self.prompt_lengths[i] + len(self.loss_masks[i])

    def numerator_mask(self, i: int) -> list[float]:
        keep = self.rejection[i] if self.rejection else [1.0] * len(self.loss_masks[i])
        return [m * k for m, k in zip(self.loss_masks[i], keep)]


def oracle_loss(step: Step, x: torch.Tensor, mode: LossMode, denominator: str) -> torch.Tensor:
    """Whole-step loss straight from the formula (loops; differentiable in ``x``)."""
    n = len(step.group_ids)
    num = [sum(m * x[step.offsets[i] + t] for t, m in enumerate(step.numerator_mask(i)))
           for i in range(n)]
    den_masks = ([step.numerator_mask(i) for i in range(n)] if denominator == "surviving"
                 else step.loss_masks)
    tokens = [sum(m) for m in den_masks]
    zero = x.sum() * 0.0
    if mode is LossMode.TOKEN_MEAN:
        total = sum(tokens)
        return sum(num, zero) / total if total else zero
    if mode is LossMode.GROUP_TOKEN_MEAN:
        out = zero
        for g in dict.fromkeys(step.group_ids):
            members = [i for i in range(n) if step.group_ids[i] == g]
            mg = sum(tokens[i] for i in members)
            if mg:
                out = out + sum((num[i] for i in members), zero) / mg
        return out / step.num_groups
    if mode is LossMode.SAMPLE_TOKEN_MEAN:
        return sum((num[i] / tokens[i] for i in range(n) if tokens[i]), zero) / n
    return sum(num, zero) / step.norm / n


@dataclass
class Split:
    """How a step is spread: sample -> DP rank, sample -> micro-batch, K per rank, CP size."""

    dp: int
    cp: int
    num_microbatches: int
    rank_of: list[int]
    microbatch_of: list[int]


def local_rows(step: Step, split: Split, d: int, c: int, k: int, x: torch.Tensor, dens):
    """The packed row of micro-batch ``k`` on DP rank ``d``, CP rank ``c``."""
    ids = [i for i in range(len(step.group_ids))
           if split.rank_of[i] == d and split.microbatch_of[i] == k]
    if not ids:
        return None
    totals = [step.total_length(i) for i in ids]
    resp = [len(step.loss_masks[i]) for i in ids]
    row_x = torch.cat([x[step.offsets[i]:step.offsets[i + 1]] for i in ids])
    row_m = torch.tensor([v for i in ids for v in step.numerator_mask(i)], dtype=x.dtype)
    local_x, lengths = slice_packed_response(row_x, totals, resp, c, split.cp)
    local_m, _ = slice_packed_response(row_m, totals, resp, c, split.cp)
    den = torch.as_tensor(dens[ids], dtype=torch.float64)
    return local_x, local_m, sample_index_from_lengths(lengths), den


def step_denominators(step: Step, mode: LossMode, denominator: str):
    return sample_denominators(mode, step.group_ids, step.loss_masks, norm=step.norm,
                               rejection_masks=step.rejection, denominator=denominator)


def emulate_megatron(step: Step, split: Split, x: torch.Tensor, mode: LossMode,
                     denominator: str, path: str = "pair"):
    """What Megatron + DDP apply, summed into one scalar: its gradient is the applied gradient.

    Returns ``(applied_loss, partials_per_rank)``; ``partials_per_rank`` maps each (d, c) to
    the sum of its micro-batches' partial numerators, as a rank would report them.
    """
    dens = step_denominators(step, mode, denominator)
    n_samples = len(step.group_ids)
    K = split.num_microbatches
    pieces, partials, local_tokens = [], {}, 0
    for d in range(split.dp):
        for c in range(split.cp):
            partials[(d, c)] = 0.0
            for k in range(K):
                row = local_rows(step, split, d, c, k, x, dens)
                if row is None:
                    continue
                p = microbatch_loss(*row)
                partials[(d, c)] += float(p.detach())
                local_tokens += int(row[1].sum())
                pieces.append(p)
    total_p = sum(pieces, x.sum() * 0.0)
    args = (mode, K, step.num_groups, split.dp, split.cp)
    if path == "per_token":
        s = megatron_loss_scale(*args, num_samples=n_samples, path=path,
                                total_num_tokens=local_tokens)
        applied = total_p * s / local_tokens if local_tokens else total_p * 0.0
    else:
        s = megatron_loss_scale(*args, num_samples=n_samples, path=path)
        per_mb = split.cp / K if path == "pair" else 1.0 / K  # Megatron's own scaling
        applied = total_p * s * per_mb / (split.dp * split.cp)  # DDP average over dp*cp
    return applied, partials


def assert_zigzag_invariants(total_length: int, response_length: int, cp_size: int) -> None:
    """Chunks tile the padded sequence; response ranges tile [0, R) exactly once."""
    offs: list[ZigzagOffsets] = [zigzag_offsets(total_length, response_length, r, cp_size)
                                 for r in range(cp_size)]
    chunk = offs[0].chunk_size
    assert chunk * 2 * cp_size >= total_length > (chunk - 1) * 2 * cp_size
    starts = sorted(a for o in offs for a, _ in o.chunks)
    assert starts == [i * chunk for i in range(2 * cp_size)]
    owned = sorted(j for o in offs for a, b in o.response for j in range(a, b))
    assert owned == list(range(response_length))
    prompt = total_length - response_length
    for o in offs:
        for (la, lb), (ta, tb), (ra, rb), (ca, cb) in zip(o.logits, o.tokens, o.response,
                                                          o.chunks):
            assert lb - la == tb - ta == rb - ra
            if lb > la:
                assert (ta, tb) == (la + 1, lb + 1) and ca <= la and lb <= cb
                assert ra == la - (prompt - 1)


def assert_metric_invariants(m: Metric) -> None:
    """A metric is finite-count, non-negative, and has no value (None) when empty."""
    assert m.count >= 0 and math.isfinite(m.count)
    assert m.reduction in ("mean", "min", "max")
    if m.count == 0:
        assert m.value is None


def divisor(step: Step, mode: LossMode) -> int:
    return step_divisor(mode, step.num_groups, len(step.group_ids))
