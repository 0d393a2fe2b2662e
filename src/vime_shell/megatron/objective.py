"""The per-micro-batch training objective, assembled from ``vime_pure``'s loss accounting.

Purpose: what Megatron's ``loss_func`` computes on the last pipeline stage for one packed row.
The shell only wires tensors; every formula lives in the core:

1. per-token log-probs and entropies of the row's scored response tokens from the
   vocab-parallel logits (Megatron's vocab-parallel cross entropy; entropy with the same
   max/sum all-reduces), so TP needs no logits gather;
2. per-token pieces from ``vime_pure.torch_ops.policy_loss.policy_loss`` (``sft_terms``
   under ``--loss-type sft_loss``: each token's negative log-likelihood) (the PPO/GRPO, GSPO
   or CISPO surrogate, dual clip, KL, entropy bonus; under context parallelism GSPO's
   per-sample sums go through :func:`cp_sum`, so each CP rank clips the whole sample's
   sequence ratio); without old log-probs the ratio is 1 and carries
   the gradient; with ``--use-tis`` the surrogate is decoupled PPO's, weighted by
   ``tis_weights(old, behaviour)`` (``vime_pure.torch_ops.offpolicy``), reported as
   ``TIS_KEYS``; rejection (MIS / IcePop) already zeroed the record's mask; ``--kl-coef``
   (REINFORCE++-baseline) and ``--use-opd`` (the teacher, or the rollout's per-token
   ``opd_reverse_kl`` under top-k distillation) shape the advantages first;
3. partial numerators ``P = sum_t m[t] * x[t] / D[sample(t)]`` of the loss and every reported
   term at once, from ``vime_pure.torch_ops.loss.microbatch_losses`` over the record's
   **step-level** denominators
   (``rank_batch`` computed them for the record's ``loss_mode``);
4. the factor ``vime_pure.megatron_loss_scale(record.loss_mode, K, G_s, dp, cp, path="pair")``
   that makes Megatron's ``*cp / K`` and DDP's ``/(dp*cp)`` cancel. The mode comes from the
   record, so the denominators and the divisor cannot disagree.

Reported per row (``STEP_KEYS``): the partial numerators of ``loss``, ``pg_loss``, ``kl``,
``entropy`` and ``clipfrac``, which ``vime_pure.reduce_train_step`` divides by the step
divisor; ``(sum, count)`` token metrics (``TOKEN_KEYS``: ``ratio``, ``log_prob``) for
``vime_pure.reduce_metrics`` (with ``TIS_KEYS`` under ``--use-tis``); and, on the batch's first
step when all its samples are fresh (no old log-probs: the forward runs on the generation
weights, the ratio is exactly 1), the engine-trainer log-prob gap.

Example: one group of 2 samples with masks ``[1, 1]`` and ``[1, 0]`` (``D = 3``), per-token
losses ``[1, 2]`` and ``[3, 9]``: ``P = (1 + 2 + 3) / 3 = 2.0``; with ``G_s = 1`` the step loss
is 2.0.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from torch.utils.checkpoint import checkpoint

from vime_pure.data.microbatch import TrainMicroBatch
from vime_pure.denominators import megatron_loss_scale
from vime_pure.errors import LossConfigError, field_error
from vime_pure.policy_config import LossConfig
from vime_pure.torch_ops.loss import microbatch_losses
from vime_pure.torch_ops.policy_loss import (kl_penalty, kl_shaped_advantages, policy_loss,
                                              sft_terms, tis_weights)
from vime_shell.megatron.tensors import MicroBatchTensors

STEP_KEYS: tuple[str, ...] = ("loss", "pg_loss", "kl", "entropy", "clipfrac")  # divided by C
TOKEN_KEYS: tuple[str, ...] = ("ratio", "log_prob")  # token means: Metric(sum, tokens)
TIS_KEYS: tuple[str, ...] = ("tis", "tis_clipfrac")  # token means too, with --use-tis
OPD_KEYS: tuple[str, ...] = ("opd_reverse_kl",)  # a token mean too, with --use-opd


def extra_token_keys(cfg: LossConfig) -> tuple[str, ...]:
    """The token means a row reports beside ``TOKEN_KEYS`` (the step's and the rollout
    record's): ``TIS_KEYS`` with ``--use-tis``, ``OPD_KEYS`` with ``--use-opd``."""
    tis = cfg.use_tis and cfg.tis_function != "mis"  # mis: whole-sample metrics (offpolicy)
    return (TIS_KEYS if tis else ()) + (OPD_KEYS if cfg.opd_kl_coef else ())


def loss_factor(record: TrainMicroBatch, dp: int, cp: int) -> float:
    """``megatron_loss_scale`` of the record's step on Megatron's ``(loss, metrics)`` path.

    Example: group_token_mean, 4 micro-batches per rank, 8 groups, dp 2: ``4 * 2 / 8 = 1.0``.
    """
    return megatron_loss_scale(record.loss_mode, record.num_microbatches, record.num_groups,
                               dp, cp, num_samples=record.num_samples, path="pair")


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy per row of ``logits`` ``[R, V/tp]`` sharded over the TP group's vocabulary.

    ``H = log Z - sum_v p_v z_v`` with ``z`` shifted by the global max; the two sums over the
    vocabulary are all-reduced with Megatron's autograd-aware reduction (identity backward).
    Example: uniform logits over V = 4 (any TP split) give ``log 4 = 1.386``.
    """
    shift = logits.detach().max(dim=-1, keepdim=True).values
    if mpu.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    z = logits - shift
    e = z.exp()
    total = reduce_from_tensor_model_parallel_region(e.sum(dim=-1))
    weighted = reduce_from_tensor_model_parallel_region((e * z).sum(dim=-1))
    return total.log() - weighted / total


def response_log_probs(output: torch.Tensor, row: MicroBatchTensors, with_entropy: bool,
                       recompute: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the row's scored response tokens from vocab-parallel logits
    ``output`` ``[rows, columns, V/tp]`` (one row when packed): only the ``R`` positions at
    ``row.logit_index`` (flat ``rows * columns`` order) are used.

    ``recompute`` (``--recompute-loss-function``): the fp32 ``[R, V/tp]`` intermediates are
    not kept for the backward but recomputed there (``torch.utils.checkpoint``); one fp32 copy
    of 16384 tokens x 151936 vocabulary rows at TP 1 is 10 GB."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(_response_log_probs, output, row, with_entropy, use_reentrant=False)
    return _response_log_probs(output, row, with_entropy)


def _response_log_probs(output: torch.Tensor, row: MicroBatchTensors, with_entropy: bool
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = output.reshape(-1, output.shape[-1])[row.logit_index].float()
    targets = row.labels.reshape(-1)[row.logit_index]
    entropy = vocab_parallel_entropy(logits) if with_entropy else None
    # Megatron's cross entropy shifts its input in place: give it its own copy.
    logp = -vocab_parallel_cross_entropy(logits.clone(), targets)
    return logp, entropy


def cp_sum(group: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The sum over the CP ``group``, differentiable (its backward sums the gradients over the
    group too), as ``policy_loss``'s ``reduce``: every CP rank's loss then depends on every
    rank's slice of a sample, and the gradients reach each slice's own rank."""
    return lambda t: dist_nn.all_reduce(t, op=dist.ReduceOp.SUM, group=group)


def microbatch_objective(logp: torch.Tensor, row: MicroBatchTensors, cfg: LossConfig,
                         factor: float, entropy: torch.Tensor | None = None,
                         cp_group: Any = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scaled loss to backpropagate, and the row's report sums (see the module docstring).
    ``cp_group``: the CP group under context parallelism (GSPO reduces over it)."""
    old = row.old_log_probs if row.old_log_probs is not None else logp.detach()
    tis: torch.Tensor | None = None
    if cfg.loss_type == "sft_loss":  # the policy knobs are refused beside it (settings)
        terms = sft_terms(logp, entropy=entropy)
    else:
        terms, tis = _policy_terms(logp, old, row, cfg, entropy, cp_group)
    mask = row.loss_mask.to(logp.dtype)
    # The loss (with its gradient) and the reported terms, reduced together: one check of the
    # row's mask, indices and denominators, one weight per token.
    series = torch.stack([terms.total.to(logp.dtype)]
                         + [t.detach().to(logp.dtype) for t in (terms.pg, terms.kl,
                                                                 terms.entropy, terms.clipped)])
    sums = microbatch_losses(series, mask, row.token_sample, row.denominators)
    numerator = sums[0]
    report = {key: value.detach() for key, value in zip(STEP_KEYS, sums)}
    report["ratio"] = (terms.ratio * mask).sum().detach()
    report["log_prob"] = (logp.detach() * mask).sum()
    report["tokens"] = mask.sum().detach()
    # the decoupled-PPO weight pi_old / pi_behaviour, as clamped (tis: only with the latter)
    if tis is not None and row.rollout_log_probs is not None and cfg.tis_function != "mis":
        report.update(_tis_sums(tis, old, row.rollout_log_probs, mask))
    if cfg.opd_kl_coef and (opd_kl := opd_token_kl(old, row)) is not None:
        report["opd_reverse_kl"] = (opd_kl * mask).sum().detach()  # the student's reverse KL
    report.update(_gap_sums(logp, row))
    return numerator * factor, report


def _policy_terms(logp: torch.Tensor, old: torch.Tensor, row: MicroBatchTensors,
                  cfg: LossConfig, entropy: torch.Tensor | None, cp_group: Any
                  ) -> tuple[Any, torch.Tensor | None]:
    """The policy loss's per-token pieces and the TIS weights (None without ``--use-tis``)."""
    tis = None
    if cfg.use_tis and cfg.tis_function == "mis":  # whole-sample weights, with the records
        if row.is_weights is None:
            raise field_error(LossConfigError, "tis_function", "mis",
                              "needs the records' is_weights, which this row lacks",
                              "attach them with vime_pure.data.rejection.with_is_weights")
        tis = row.is_weights.to(logp.dtype)
    elif cfg.use_tis:
        if row.rollout_log_probs is None:
            raise field_error(LossConfigError, "use_tis", True,
                              "needs the engine's rollout log-probs, which this batch lacks",
                              "record rollout_log_probs in the rollout function, or drop --use-tis")
        tis = tis_weights(old, row.rollout_log_probs, cap=cfg.tis_clip, low=cfg.tis_clip_low,
                          icepop=cfg.tis_function == "icepop")
    advantages = row.advantages
    if cfg.reward_kl_coef:  # --kl-coef: slime's KL in the reward (REINFORCE++-baseline)
        if row.ref_log_probs is None:
            raise field_error(LossConfigError, "reward_kl_coef", cfg.reward_kl_coef,
                              "needs the reference log-probs, which this batch lacks",
                              "load the reference model (the loop does for --kl-coef)")
        advantages = kl_shaped_advantages(advantages, old, row.ref_log_probs,
                                          coef=cfg.reward_kl_coef, kind=cfg.kl_kind)
    if cfg.opd_kl_coef:  # --use-opd: the reverse KL to the teacher, on any estimator (slime)
        advantages = opd_shaped_advantages(advantages, old, row, cfg.opd_kl_coef)
    terms = policy_loss(logp, old, advantages, ref_log_probs=row.ref_log_probs,
                        kl_coef=cfg.kl_coef, kl_kind=cfg.kl_kind, eps_clip=cfg.eps_clip,
                        eps_clip_high=cfg.eps_clip_high, dual_clip=cfg.dual_clip,
                        entropy=entropy, entropy_coef=cfg.entropy_coef, tis=tis,
                        surrogate=cfg.surrogate, loss_mask=row.loss_mask.to(logp.dtype),
                        sample_index=row.token_sample, num_samples=len(row.denominators),
                        reduce=None if cp_group is None else cp_sum(cp_group))
    return terms, tis


def opd_token_kl(old: torch.Tensor, row: MicroBatchTensors) -> torch.Tensor | None:
    """Each scored token's reverse-KL estimate against the teacher: the rollout's own
    (``opd_reverse_kl``, miles' top-k distillation) when the row carries it, else the sampled
    token's ``old - teacher`` log-prob (slime's); None when the row has neither."""
    if row.opd_reverse_kl is not None:
        return row.opd_reverse_kl
    return None if row.teacher_log_probs is None else \
        kl_penalty(old.detach(), row.teacher_log_probs, "k1")


def opd_shaped_advantages(advantages: torch.Tensor, old: torch.Tensor,
                          row: MicroBatchTensors, coef: float) -> torch.Tensor:
    """``--use-opd``: each token's advantage minus ``coef`` times its reverse KL to the
    teacher (:func:`opd_token_kl`), detached. Example: ``A = 1``, ``opd_reverse_kl = 0.5``,
    ``coef = 0.2``: ``0.9``."""
    kl = opd_token_kl(old, row)
    if kl is None:
        raise field_error(LossConfigError, "opd_kl_coef", coef,
                          "needs the teacher's log-probs or the rollout's opd_reverse_kl, "
                          "which this batch lacks",
                          "load the teacher (the loop does for --opd-type megatron), ask the "
                          "teacher server for every sample (--opd-type sglang), or set "
                          "opd_reverse_kl on every sample (top-k distillation)")
    return advantages - coef * kl.detach()


def _tis_sums(tis: torch.Tensor, old: torch.Tensor, behaviour: torch.Tensor,
              mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Masked sums of the TIS weight and of where the clamp changed it (``TIS_KEYS``);
    ``behaviour``: the engine's log-probs."""
    raw = torch.exp((old - behaviour).clamp(max=20.0))
    clamped = (tis != raw).to(mask.dtype)
    return {"tis": (tis.to(mask.dtype) * mask).sum().detach(),
            "tis_clipfrac": (clamped * mask).sum().detach()}


def _gap_sums(logp: torch.Tensor, row: MicroBatchTensors) -> dict[str, torch.Tensor]:
    """|trainer - engine| log-prob sums over the row's scored tokens, when this forward runs on
    the weights the engine generated with (no old log-probs: an all-fresh first step), so the
    weight-sync check needs no forward of its own. Empty otherwise."""
    if row.old_log_probs is not None or row.rollout_log_probs is None:
        return {}
    # Loss-masked tokens are skipped: tool output was never sampled (its log-probs are 0)
    # and masked off-policy tokens came from older weights.
    diff = (logp.detach() - row.rollout_log_probs.to(logp.dtype)).abs()[row.loss_mask > 0]
    return {"gap_sum": diff.sum(), "gap_tokens": torch.tensor(float(diff.numel())),
            "gap_max": diff.max() if diff.numel() else torch.tensor(0.0)}
