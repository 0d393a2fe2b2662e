"""The per-micro-batch training objective: per-token policy loss, group reduction, Megatron scale.

Purpose: what ``loss_func`` computes on the last pipeline stage for one packed row.

1. per-token log-probs ``logp`` of the row's response tokens (from the model's vocab-parallel
   cross entropy, so TP needs no logits gather);
2. per-token loss: PPO clipped surrogate ``-min(rho*A, clip(rho, 1-eps_low, 1+eps_high)*A)``
   with ``rho = exp(logp - old_logp)`` (``rho = 1`` carrying the gradient when no old log-probs
   are given), plus ``kl_coef`` times the k3 estimator ``exp(ref-logp) - (ref-logp) - 1``;
3. group-token-mean numerator: ``sum_t loss_t * mask_t / denom_t`` where ``denom_t`` is the mask
   total of the token's whole group; summed over all micro-batches and ranks and divided by the
   step's group count ``G_s`` it is the mean over groups of each group's token mean;
4. the Megatron factor ``num_microbatches * dp / G_s``: Megatron's no-pipelining and pipeline
   schedules multiply the returned loss by ``cp`` and divide it by ``num_microbatches``, and DDP
   averages gradients over the ``dp * cp`` data-parallel ranks, so the factor leaves exactly
   ``numerator / G_s`` summed over the step.

Invariants (tested through the layout-equivalence test): the step's gradient and reported loss
do not depend on how the step is split into micro-batches or ranks.

Example: one group of 2 samples with masks ``[1, 1]`` and ``[1, 0]`` (denominator 3), per-token
losses ``[1, 2]`` and ``[3, 9]``, ``G_s = 1``: numerator ``(1 + 2 + 3) / 3 = 2.0``.
"""

import attrs
import torch

from vime_pure.errors import VimeError, field_error


@attrs.frozen(kw_only=True)
class LossConfig:
    """PPO/GRPO objective knobs. ``eps_high=None`` means symmetric clipping."""

    eps_low: float = 0.2
    eps_high: float | None = None
    kl_coef: float = 0.0

    def __attrs_post_init__(self) -> None:
        if not 0.0 < self.eps_low < 1.0:
            raise field_error(VimeError, "eps_low", self.eps_low, "must lie in (0, 1)",
                              "use e.g. 0.2")
        if self.eps_high is not None and self.eps_high <= 0.0:
            raise field_error(VimeError, "eps_high", self.eps_high, "must be positive",
                              "use e.g. 0.28 or None")
        if self.kl_coef < 0.0:
            raise field_error(VimeError, "kl_coef", self.kl_coef, "must be >= 0",
                              "use 0 to disable the KL penalty")


def megatron_loss_factor(num_microbatches: int, num_groups: int, dp: int) -> float:
    """Factor that makes Megatron's ``/num_microbatches`` and DDP's ``/(dp*cp)`` cancel.

    Example: 4 micro-batches per rank, 8 groups, dp 2: ``4 * 2 / 8 = 1.0``.
    """
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        raise field_error(VimeError, "num_groups", num_groups, "must be a positive integer",
                          "pass the step's group count G_s from the schedule")
    return num_microbatches * dp / num_groups


def token_losses(logp: torch.Tensor, row, cfg: LossConfig) -> tuple[torch.Tensor, dict]:
    """Per-token loss of the row's response tokens and per-token statistics to report."""
    old = row.old_log_probs if row.old_log_probs is not None else logp.detach()
    ratio = torch.exp(logp - old)
    high = cfg.eps_high if cfg.eps_high is not None else cfg.eps_low
    clipped = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + high)
    adv = row.advantages
    pg = -torch.minimum(ratio * adv, clipped * adv)
    stats = {"pg_loss": pg.detach(), "ratio": ratio.detach(),
             "clipfrac": ((ratio * adv) > (clipped * adv)).float(), "log_prob": logp.detach()}
    loss = pg
    if cfg.kl_coef > 0.0 and row.ref_log_probs is not None:
        diff = row.ref_log_probs - logp
        kl = torch.exp(diff) - diff - 1.0
        loss = loss + cfg.kl_coef * kl
        stats["kl"] = kl.detach()
    return loss, stats


def group_weights(row) -> torch.Tensor:
    """``mask / group_denominator`` per token (0 where the whole group is masked out)."""
    safe = torch.where(row.denominators > 0, row.denominators, torch.ones_like(row.denominators))
    return torch.where(row.denominators > 0, row.loss_mask / safe, torch.zeros_like(safe))


def microbatch_loss(logp: torch.Tensor, row, cfg: LossConfig, factor: float
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scaled loss to backpropagate and ``{name: [sum, count]}`` metric tensors for the row."""
    loss, stats = token_losses(logp, row, cfg)
    numerator = (loss * group_weights(row)).sum()
    mask = row.loss_mask
    count = mask.sum().detach()
    metrics = {"loss": torch.stack([numerator.detach(), torch.zeros_like(count)])}
    for name, values in stats.items():
        metrics[name] = torch.stack([(values * mask).sum(), count])
    metrics["tokens"] = torch.stack([count, torch.ones_like(count)])
    return numerator * factor, metrics
