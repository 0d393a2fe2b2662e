"""Worker of the share rejection test: one 4-process gloo world runs ``--use-rs`` and the MIS
weights (``--tis-function mis``) as the step does (``vime_shell.train.offpolicy``) on each
(dp, cp) layout of 4 ranks, and checks every rank's records against the core applied in one
process to the whole batch (the verdict; the weights, batch-normalized per step).

Each rank builds its records from its DP share (``share_batch`` with its CP rank), fills the
old log-probs of the tokens it scores (a fixed function of the batch position; NaN
elsewhere, as the trainer's CP ranks do), completes them over its CP group
(``share_log_probs``) and applies the rejection (``reject``: the surviving totals and
``rejected_token_frac`` summed over the world, one rank per DP replica counting).
"""


import numpy as np
import torch
import torch.distributed as dist

from tests.shell.gloo_world import worker_body
from vime_pure import BatchingPolicy, ParallelLayout, RolloutBatch
from vime_pure.data.batch import schedule_for
from vime_pure.data.microbatch import share_batch, step_of_sample
from vime_pure.data.sample import Sample
from vime_pure.data.shares import share_of_batch
from vime_pure.denominators import step_denominators
from vime_pure.policy_config import MisConfig, RejectionConfig
from vime_pure.torch_ops.mis import mis_weights, norm_factors, norm_terms
from vime_pure.torch_ops.offpolicy import rejection_keep
from vime_shell.train import offpolicy

LAYOUTS = [(4, 1), (2, 2), (1, 4)]
LEVELS = ("token", "sequence", "geometric")
MIS_CONFIGS = {  # one per level and mode; batch normalization where mis.py has it
    "token": MisConfig(level="token", mode="truncate", lower=0.9, upper=1.1,
                       batch_normalize=True),
    "sequence": MisConfig(level="sequence", mode="clip", lower=0.5, upper=2.0,
                          batch_normalize=True),
    "geometric": MisConfig(level="geometric", mode="mask", lower=0.95, upper=1.05)}
NORM = 16.0


def make_batch() -> RolloutBatch:
    """12 prompts' groups of 1-3 samples, responses of 3-12 tokens, some masked tokens."""
    rng = np.random.default_rng(7)
    prompts = []
    for p in range(12):
        group = []
        for _ in range(int(rng.integers(1, 4))):
            prompt, resp = int(rng.integers(2, 6)), int(rng.integers(3, 13))
            group.append(Sample(
                tokens=rng.integers(0, 50, prompt + resp).tolist(), response_length=resp,
                loss_mask=(rng.random(resp) < 0.8).astype(int).tolist(), reward=float(p % 2),
                group_id=f"g{p}", rollout_log_probs=(-rng.random(resp) * 2).tolist()))
        prompts.append(group)
    return RolloutBatch.from_samples(prompts)


def old_of(batch: RolloutBatch) -> np.ndarray:
    """The old log-probs of every batch response token: behaviour plus a drift that puts some
    ratios outside the band."""
    drift = np.random.default_rng(11).normal(0.0, 0.2, int(batch.response_offsets[-1]))
    return batch.rollout_log_probs.astype(np.float64) + drift


def rank_inputs(rank: int, dp: int, cp: int, cp_group, steps: int = 1):
    """The batch, its schedule (``steps`` optimizer steps), this rank's share and records, and
    the share's old log-probs completed over the CP group as the step does."""
    batch = make_batch()
    schedule = schedule_for(batch, ParallelLayout(dp=dp), BatchingPolicy(
        global_batch_size=batch.num_groups // steps, max_tokens_per_gpu=64))
    d, c = divmod(rank, cp)
    share = share_of_batch(batch, schedule.rank_sample_ids(d))
    rank_records = share_batch(share, schedule, batch.mask_sums, dp_rank=d, cp_rank=c,
                               cp_size=cp, loss_mode="group_token_mean", norm=NORM)
    whole_old = old_of(batch)
    old = np.full(share.num_response_tokens, np.nan)
    for mb in rank_records.microbatches:  # this CP rank scores these tokens only
        old[mb.share_index] = whole_old[mb.response_index]
    full = offpolicy.share_log_probs(old, cp_group, torch.device("cpu"))
    return batch, schedule, share, rank_records, whole_old, full


def run_layout(rank: int, dp: int, cp: int, cp_group, level: str, denominator: str) -> dict:
    batch, schedule, share, rank_records, whole_old, full = rank_inputs(rank, dp, cp, cp_group)
    c = rank % cp
    config = RejectionConfig(level=level, lower=0.8, upper=1.25, denominator=denominator)
    mine, metrics = offpolicy.reject(rank_records, share, schedule, full, config, NORM,
                                     counts=c == 0, device=torch.device("cpu"))
    # The reference: the core's verdict on the whole batch, in one process.
    keep = rejection_keep(torch.from_numpy(whole_old),
                          torch.from_numpy(batch.rollout_log_probs.astype(np.float64)),
                          torch.from_numpy(batch.loss_masks.astype(np.float64)),
                          torch.from_numpy(np.repeat(np.arange(batch.num_samples),
                                                     batch.response_lengths)), config).numpy()
    masks = batch.loss_masks.astype(np.float64)
    sums = np.add.reduceat(masks * keep if denominator == "surviving" else masks,
                           batch.response_offsets[:-1])
    dens = step_denominators("group_token_mean", schedule.group_array, sums,
                             step_of_sample(schedule), norm=NORM)
    wrong_masks = wrong_dens = 0
    for mb in mine.microbatches:
        want = (batch.loss_masks[mb.response_index] * keep[mb.response_index]).astype(np.float32)
        wrong_masks += int((mb.loss_mask != want).sum())
        wrong_dens += int((mb.denominators != dens[mb.sample_indices]).sum())
    rejected = float((masks * (1 - keep)).sum() / masks.sum())
    return {"wrong_masks": wrong_masks, "wrong_dens": wrong_dens,
            "frac": metrics["rejected_token_frac"], "want_frac": rejected,
            "unfilled": int(np.isnan(full).sum()), "rejected_tokens": int((keep == 0).sum())}


def run_mis_layout(rank: int, dp: int, cp: int, cp_group, config: MisConfig) -> dict:
    """``importance`` (and, for mode mask, its keep through ``reject``) on this rank's share
    of a 3-step batch, against the core on the whole batch normalized step by step."""
    batch, schedule, share, rank_records, whole_old, full = rank_inputs(rank, dp, cp, cp_group,
                                                                        steps=3)
    cpu = torch.device("cpu")
    mine, keep, metrics = offpolicy.importance(rank_records, share, schedule, full, config,
                                               counts=rank % cp == 0, device=cpu)
    if keep is not None:  # mode mask
        mine, _ = offpolicy.reject(mine, share, schedule, full, None, NORM,
                                   counts=rank % cp == 0, device=cpu, keep=keep)
    masks = torch.from_numpy(batch.loss_masks.astype(np.float64))
    index = torch.from_numpy(np.repeat(np.arange(batch.num_samples), batch.response_lengths))
    whole = mis_weights(torch.from_numpy(whole_old),
                        torch.from_numpy(batch.rollout_log_probs.astype(np.float64)), masks,
                        index, config)
    weights = whole.weights
    if config.batch_normalize:
        steps = torch.from_numpy(step_of_sample(schedule))
        sums = [torch.zeros(schedule.num_steps, dtype=torch.float64).index_add_(0, steps, t)
                for t in norm_terms(weights, masks, index, config.level)]
        weights = weights / norm_factors(*sums)[steps][index]
    want_mask = (masks * whole.keep).numpy()
    wrong_weights = wrong_masks = 0
    for mb in mine.microbatches:
        want = weights.numpy()[mb.response_index].astype(np.float32)
        wrong_weights += int((~np.isclose(mb.is_weights, want, rtol=1e-6, atol=0)).sum())
        wrong_masks += int((mb.loss_mask != want_mask[mb.response_index]).sum())
    before = whole.metrics["tis_weight_before_bound"]
    return {"wrong_weights": wrong_weights, "wrong_masks": wrong_masks,
            "before": metrics["mis_tis_weight_before_bound"],
            "want_before": float((before * masks).sum() / masks.sum()),
            "spread": float(weights.max() - weights.min()), "steps": schedule.num_steps}


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    worker_body(rank, world, init_file, out_dir, _layouts)


def _layouts(rank: int, result: dict) -> None:
    for dp, cp in LAYOUTS:
        # every rank joins every new_group; a rank uses its DP replica's
        groups = [dist.new_group(list(range(i * cp, (i + 1) * cp))) for i in range(dp)]
        cp_group = groups[rank // cp] if cp > 1 else None
        for level in LEVELS:
            for denominator in ("original", "surviving"):
                result[f"{dp}x{cp}:{level}:{denominator}"] = run_layout(
                    rank, dp, cp, cp_group, level, denominator)
            result[f"mis:{dp}x{cp}:{level}"] = run_mis_layout(rank, dp, cp, cp_group,
                                                              MIS_CONFIGS[level])
