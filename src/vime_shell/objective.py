"""The per-micro-batch training objective, assembled from ``vime_pure``'s loss accounting.

Purpose: what Megatron's ``loss_func`` computes on the last pipeline stage for one packed row.
The shell only wires tensors; every formula lives in the core:

1. per-token log-probs and entropies of the row's response tokens from the vocab-parallel
   logits (Megatron's vocab-parallel cross entropy; entropy with the same max/sum all-reduces),
   so TP needs no logits gather;
2. per-token pieces from ``vime_pure.policy_loss.policy_loss`` (PPO/GRPO clipped surrogate,
   optional dual clip, KL k1/k3, entropy bonus); with no old log-probs the ratio is 1 and
   carries the gradient;
3. partial numerators ``P = sum_t m[t] * x[t] / D[t]`` from ``vime_pure.loss.microbatch_loss``
   over the **step-level** denominators ``D`` the rows carry (``vime_pure.sample_denominators``);
4. the factor ``vime_pure.loss.megatron_loss_scale(mode, K, G_s, dp, cp, path="pair")`` =
   ``K * dp / C`` that makes Megatron's ``*cp / K`` and DDP's ``/(dp*cp)`` cancel.

Reported per row: the partial numerators of ``loss``, ``pg_loss``, ``kl``, ``entropy`` and
``clipfrac``
(divided by the step divisor ``C`` after the all-reduce, like ``vime_pure.reduce_train_step``)
and token (sum, count) pairs of ``ratio`` and ``log_prob``.

Example: one group of 2 samples with masks ``[1, 1]`` and ``[1, 0]`` (``D = 3``), per-token
losses ``[1, 2]`` and ``[3, 9]``: ``P = (1 + 2 + 3) / 3 = 2.0``; with ``G_s = 1`` the step loss
is 2.0.
"""

import attrs
import torch

from vime_pure.denominators import LossMode
from vime_pure.errors import VimeError, field_error
from vime_pure.loss import megatron_loss_scale, microbatch_loss as partial_numerator
from vime_pure.policy_loss import policy_loss

STEP_KEYS: tuple[str, ...] = ("loss", "pg_loss", "kl", "entropy", "clipfrac")  # divided by C
TOKEN_KEYS: tuple[str, ...] = ("ratio", "log_prob")  # token means (sum / tokens)


@attrs.frozen(kw_only=True)
class LossConfig:
    """Objective knobs. ``mode`` must match how the rows' ``denominators`` were computed."""

    mode: LossMode = attrs.field(default=LossMode.GROUP_TOKEN_MEAN, converter=LossMode.parse)
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    entropy_coef: float = 0.0

    def __attrs_post_init__(self) -> None:
        if not 0.0 < self.eps_clip < 1.0:
            raise field_error(VimeError, "eps_clip", self.eps_clip, "must lie in (0, 1)",
                              "use e.g. 0.2")
        if self.kl_coef < 0.0:
            raise field_error(VimeError, "kl_coef", self.kl_coef, "must be >= 0",
                              "use 0 to disable the KL penalty")
        if self.entropy_coef < 0.0:
            raise field_error(VimeError, "entropy_coef", self.entropy_coef, "must be >= 0",
                              "use 0 to disable the entropy bonus")
        if self.kl_kind not in ("k1", "k3"):
            raise field_error(VimeError, "kl_kind", self.kl_kind, "is not a KL estimator",
                              "use 'k1' or 'k3'")


def loss_factor(cfg: LossConfig, num_microbatches: int, num_groups: int, num_samples: int,
                dp: int, cp: int) -> float:
    """``megatron_loss_scale`` for Megatron's ``(loss, metrics)`` return path.

    Example: group_token_mean, 4 micro-batches per rank, 8 groups, dp 2: ``4 * 2 / 8 = 1.0``.
    """
    return megatron_loss_scale(cfg.mode, num_microbatches, num_groups, dp, cp,
                               num_samples=num_samples, path="pair")


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy per row of ``logits`` ``[R, V/tp]`` sharded over the TP group's vocabulary.

    ``H = log Z - sum_v p_v z_v`` with ``z`` shifted by the global max; the two sums over the
    vocabulary are all-reduced with Megatron's autograd-aware reduction (identity backward).
    Example: uniform logits over V = 4 (any TP split) give ``log 4 = 1.386``.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    shift = logits.detach().max(dim=-1, keepdim=True).values
    if mpu.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    z = logits - shift
    e = z.exp()
    total = reduce_from_tensor_model_parallel_region(e.sum(dim=-1))
    weighted = reduce_from_tensor_model_parallel_region((e * z).sum(dim=-1))
    return total.log() - weighted / total


def response_log_probs(output: torch.Tensor, row, with_entropy: bool
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the row's response tokens from vocab-parallel logits
    ``output`` ``[1, T, V/tp]``: only the ``R`` rows at ``row.logit_index`` are used."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = output[0, row.logit_index].float()
    targets = row.labels[0, row.logit_index]
    entropy = vocab_parallel_entropy(logits) if with_entropy else None
    # Megatron's cross entropy shifts its input in place: give it its own copy.
    logp = -vocab_parallel_cross_entropy(logits.clone(), targets)
    return logp, entropy


def microbatch_objective(logp: torch.Tensor, row, cfg: LossConfig, factor: float,
                         entropy: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scaled loss to backpropagate, and the row's report sums (see the module docstring)."""
    old = row.old_log_probs if row.old_log_probs is not None else logp.detach()
    terms = policy_loss(logp, old, row.advantages, ref_log_probs=row.ref_log_probs,
                        kl_coef=cfg.kl_coef, kl_kind=cfg.kl_kind, eps_clip=cfg.eps_clip,
                        eps_clip_high=cfg.eps_clip_high, dual_clip=cfg.dual_clip,
                        entropy=entropy, entropy_coef=cfg.entropy_coef)
    # Per-token denominators: token t is its own "sample" whose D is its sample's D.
    index = torch.arange(logp.numel(), device=logp.device)
    dens = row.denominators.to(logp.dtype)
    mask = row.loss_mask.to(logp.dtype)
    numerator = partial_numerator(terms.total, mask, index, dens)
    report = {"loss": numerator.detach()}
    for key, values in (("pg_loss", terms.pg), ("kl", terms.kl), ("entropy", terms.entropy),
                        ("clipfrac", terms.clipped)):
        report[key] = partial_numerator(values.to(logp.dtype), mask, index, dens).detach()
    report["ratio"] = (terms.ratio * mask).sum().detach()
    report["log_prob"] = (logp.detach() * mask).sum()
    report["tokens"] = mask.sum().detach()
    return numerator * factor, report
