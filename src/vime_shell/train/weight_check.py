"""The weight-sync check: the engine-trainer log-prob gap, measured over the world and held
against ``--logprob-gap-tolerance`` (the loop's step 4, :mod:`vime_shell.run.driver`).

The engine generated rollout ``k`` right after the sync that ended rollout ``k - 1``, so the mean
|engine - trainer| log-prob over the fresh samples' loss-masked tokens measures that sync: fp32
noise is ~1e-6 on average (single extreme tokens of a sharp policy reach ~1e-4), a missed sync
moves every token by ~1e-3. Example: a gap of 2e-3 against the fp32 tolerance 1e-4 after the
first sync raises :class:`WeightSyncError` before any update.
"""

import attrs
import numpy as np
import torch
import torch.distributed as dist

from vime_pure.errors import VimeError
from vime_pure.metrics import Metric
from vime_shell.train import offpolicy


class TrainLoopError(VimeError):
    """The loop cannot continue."""


class WeightSyncError(TrainLoopError):
    """After a weight sync the engine's log-probs differ from the trainer's: the sync failed."""


class LogprobCheckError(TrainLoopError):
    """The rollout function returned no engine log-probs: the weight-sync check cannot run."""


@attrs.define
class GapMeter:
    """The engine-trainer log-prob gap of one rollout, from the pieces that measured it
    (step 0's training forward, the recomputed old log-probs of later steps)."""

    total: float = 0.0
    tokens: float = 0.0
    max: float | None = None  # None until a token is measured, as the mean

    def add(self, mean: float, top: float, tokens: float) -> None:
        if tokens:
            self.total += mean * tokens
            self.tokens += tokens
            self.max = top if self.max is None else max(self.max, top)

    @property
    def mean(self) -> float | None:
        """None when no token had engine log-probs (nothing measured: a stale batch's, one
        step off or fully async; ``null`` in metrics.jsonl, ``-`` in the progress line)."""
        return Metric(self.total, self.tokens).value


def measure_gap(records: list, old: np.ndarray, samples: np.ndarray, *, owns_loss: bool,
                device: torch.device) -> tuple[float, float, float]:
    """Collective: mean, max and token count of |engine - trainer| log-prob over ``records``'
    scored, loss-masked tokens of the flagged ``samples`` (the fresh ones), reduced over the
    world with each (DP, CP) token counted once (by its last-stage, TP-rank-0 owner: the rank
    that ``owns_loss``); no tokens without engine log-probs (a user rollout function may not
    record them)."""
    diffs = [np.abs(old[mb.share_index] - mb.rollout_log_probs)[
                 offpolicy.scored_mask(mb, samples) & (mb.loss_mask > 0)] for mb in records
             if mb.rollout_log_probs is not None and owns_loss]
    diff = np.concatenate(diffs) if diffs else np.zeros(0)
    sums = torch.tensor([float(diff.sum()), float(diff.size)], dtype=torch.float64,
                        device=device)
    dist.all_reduce(sums)
    top = torch.tensor([float(diff.max()) if diff.size else 0.0], dtype=torch.float64,
                       device=device)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    count = float(sums[1])
    return (float(sums[0]) / count if count else 0.0), float(top.item()), count


def check_gap(rid: int, gap: GapMeter, *, tolerance: float, syncs_done: int) -> None:
    """Raise :class:`WeightSyncError` when rollout ``rid``'s mean gap is above ``tolerance``;
    the fix it names depends on whether a sync has run yet."""
    if gap.mean is None or not gap.mean > tolerance:  # None: nothing measured
        return
    head = (f"rollout {rid}: mean engine-trainer log-prob gap {gap.mean:.3g} > "
            f"--logprob-gap-tolerance {tolerance:g}.")
    if syncs_done == 0:  # both loaded --hf-checkpoint: no sync has run yet
        raise WeightSyncError(
            f"{head} No weight sync has run yet: the engine and the trainer loaded the "
            "same --hf-checkpoint but score its tokens differently (the engine's dtype, "
            "e.g. bf16, a model the trainer converts differently, or a rollout function "
            "whose log-probs are not the engine's). Fix: pass --rollout-dtype float32, "
            "check the rollout function's rollout_log_probs, or raise "
            "--logprob-gap-tolerance knowingly.")
    raise WeightSyncError(
        f"{head} The weights the engine sampled with are not the trainer's: the last "
        "weight sync failed (or the engine computes log-probs differently, e.g. in bf16). "
        "Fix: check the engine's weight update, or raise --logprob-gap-tolerance "
        "knowingly.")


def check_probe_gap(version: int, gap: GapMeter, tolerance: float) -> None:
    """Raise :class:`WeightSyncError` when the probe's gap after the sync to ``version`` (separate
    engine ranks, ``sources/probe.py``) is above ``tolerance``."""
    if gap.mean is not None and gap.mean > tolerance:
        raise WeightSyncError(
            f"weight sync to version {version}: mean engine-trainer log-prob gap "
            f"{gap.mean:.3g} on the probe > logprob_gap_tolerance={tolerance:g}. "
            "The engine ranks did not load the trainer's weights. Fix: check the engine's "
            "weight update, or raise --logprob-gap-tolerance knowingly.")
