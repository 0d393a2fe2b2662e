"""slime's mis.py importance weights (``--tis-function mis``), on whole samples.

Per response token, with ``r = log pi_old - log pi_behaviour`` and ``m`` its loss mask, the
value at ``MisConfig.level`` is ``r`` (token), ``sum_sample m * r`` (sequence) or
``sum_sample m * r / max(sum_sample m, 1)`` (geometric), spread over the sample; the raw weight
``w = exp(clamp(value, -20, 20))`` (the clamp keeps ``exp`` finite) is then bounded by the mode:

* ``truncate``: ``min(w, upper) * m``;
* ``clip``: ``clamp(w, lower, upper) * m``;
* ``mask``: ``w * m``, and the tokens whose ``w`` leaves ``[lower, upper]`` are rejected
  (``keep`` 0: they leave the loss's numerator, and stay in its denominator, as slime's).

Batch normalization divides every weight of a step by the step's mean weight
(:func:`norm_terms` per sample, summed over the step's samples on every DP rank, then
:func:`norm_factors`): token level ``sum w*m / sum m``, sequence level the mean over samples of
each sample's masked mean. mis.py takes the mean over whatever one call receives (one
micro-batch on one rank); vime takes it over the optimizer step, so the weights, like every
other number of the loss, do not depend on how the step is split (docs/slime.md says so).

Invariant the tests assert (``tests/test_mis.py``): each sample's weights and keep depend on
its own tokens only (and the step's factor); every weight is finite and >= 0, and 0 where the
mask is 0.

Example: ``r = [log 3, 0]`` in one sample, mask ``[1, 1]``, token level, truncate, upper 2:
weights ``[2, 1]``; mode mask with ``[0.5, 2]``: weights ``[3, 1]``, keep ``[0, 1]``.
"""

import attrs
import torch
from jaxtyping import Float, Int
from torch import Tensor

from vime_pure.errors import LossConfigError, field_error
from vime_pure.policy_config import MisConfig
from vime_pure.torch_ops.boundary import tensor_boundary

# mis.py's mismatch metrics (add_ppl_metrics), logged with or without its weights
MISMATCH_COLUMNS = ("training_log_ppl", "training_ppl", "rollout_log_ppl", "rollout_ppl", "kl",
                    "k3_kl", "log_ppl_diff", "log_ppl_abs_diff", "ppl_ratio", "chi2_token",
                    "chi2_seq")
SAFETY_BOUND = 20.0  # |log weight| before exp: e^20 is finite in float32
NORM_FLOOR = 1e-8  # a step mean at or below it leaves the weights unnormalized (mis.py's)


@attrs.frozen(kw_only=True, eq=False)
class MisWeights:
    """:func:`mis_weights`' result, per token: ``weights`` (the surrogate's factor),
    ``keep`` (0 where mode ``mask`` rejects) and ``metrics`` (name -> one value per token,
    slime's keys without the ``mis_`` prefix; token means over the loss mask)."""

    weights: Float[Tensor, " t"]
    keep: Float[Tensor, " t"]
    metrics: dict[str, Tensor]


@tensor_boundary
def mis_weights(old_log_probs: Float[Tensor, " t"], behaviour_log_probs: Float[Tensor, " t"],
                loss_mask: Float[Tensor, " t"], sample_index: Int[Tensor, " t"],
                config: MisConfig) -> MisWeights:
    """The weights of whole samples (``sample_index``: each token's sample, e.g. a rank's
    share). See the module docstring; no batch normalization here (:func:`norm_terms`)."""
    if not isinstance(config, MisConfig):
        raise field_error(LossConfigError, "config", type(config).__name__,
                          "is not a MisConfig", "pass MisConfig(level=..., mode=...)")
    mask = loss_mask.detach().to(torch.float64)
    log_ratio = (old_log_probs.detach() - behaviour_log_probs.detach()).to(torch.float64)
    value = level_value(log_ratio, mask, sample_index, config.level)
    raw = torch.exp(value.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    lower, upper = config.lower, config.upper
    keep = torch.ones_like(mask)
    metrics = {"tis_weight_before_bound": raw}
    if config.mode == "truncate":
        weights = raw.clamp(max=upper) * mask
        metrics["tis_truncate_fraction"] = (raw > upper).to(mask.dtype)
    else:
        low, high = (raw < lower).to(mask.dtype), (raw > upper).to(mask.dtype)
        metrics[f"tis_{config.mode}_fraction_low"] = low
        metrics[f"tis_{config.mode}_fraction_high"] = high
        if config.mode == "clip":
            weights = raw.clamp(lower, upper) * mask
        else:
            weights = raw * mask
            keep = 1.0 - low - high
    metrics["tis_weight_after_bound"] = weights
    metrics.update(mismatch_columns(old_log_probs.detach().to(torch.float64),
                                    behaviour_log_probs.detach().to(torch.float64), mask,
                                    sample_index))
    return MisWeights(weights=weights, keep=keep, metrics=metrics)


def mismatch_columns(old: Tensor, behaviour: Tensor, mask: Tensor, sample_index: Tensor
                     ) -> dict[str, Tensor]:
    """mis.py's perplexity, KL and chi-squared metrics, one value per token (a sample's value
    spread over its tokens): the trainer's (``old``) and the engine's (``behaviour``) log
    perplexity per sample and their difference, the per-token ``kl`` (behaviour - old) and
    ``k3_kl``, and ``chi2_token`` / ``chi2_seq``, the second moments of the token ratio and of
    the sample's ratio product, less 1. Example: old = behaviour gives every KL and chi2 0."""
    count = _sample_sums(mask, sample_index).clamp(min=1.0)

    def sample_mean(values: Tensor) -> Tensor:
        return (_sample_sums(values * mask, sample_index) / count)[sample_index]

    r = old - behaviour
    train_ppl, rollout_ppl = -sample_mean(old), -sample_mean(behaviour)
    diff = train_ppl - rollout_ppl  # mis.py's mean rollout log-prob - mean training log-prob
    seq = level_value(r, mask, sample_index, "sequence").clamp(-SAFETY_BOUND, SAFETY_BOUND)
    rho = torch.exp(r.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    return {"training_log_ppl": train_ppl, "training_ppl": torch.exp(train_ppl),
            "rollout_log_ppl": rollout_ppl, "rollout_ppl": torch.exp(rollout_ppl),
            "kl": -r, "k3_kl": torch.exp(r) - r - 1.0, "log_ppl_diff": diff,
            "log_ppl_abs_diff": diff.abs(), "ppl_ratio": torch.exp(diff),
            "chi2_token": sample_mean(rho**2) - 1.0,
            "chi2_seq": torch.exp(2.0 * seq) - 1.0}


def level_value(log_ratio: Tensor, mask: Tensor, sample_index: Tensor, level: str) -> Tensor:
    """Each token's log-ratio at ``level``: its own, its sample's masked sum or masked mean."""
    if level == "token":
        return log_ratio
    sums, counts = _sample_sums(log_ratio * mask, sample_index), _sample_sums(mask, sample_index)
    if level == "geometric":
        sums = sums / counts.clamp(min=1.0)
    return sums[sample_index]


@tensor_boundary
def norm_terms(weights: Float[Tensor, " t"], loss_mask: Float[Tensor, " t"],
               sample_index: Int[Tensor, " t"], level: str) -> tuple[Tensor, Tensor]:
    """Per sample, the numerator and denominator of the step's mean weight: token level
    ``(sum w*m, sum m)``; sequence level ``(masked mean of w, 1)`` (every sample counts, as in
    mis.py). Sum each over a step's samples, then :func:`norm_factors`. Example: weights
    ``[2, 1 | 4]``, masks all 1: token ``([3, 4], [2, 1])``, sequence ``([1.5, 4], [1, 1])``."""
    mask = loss_mask.detach().to(torch.float64)
    total = _sample_sums(weights.detach().to(torch.float64) * mask, sample_index)
    count = _sample_sums(mask, sample_index)
    if level == "token":
        return total, count
    if level == "sequence":
        return total / count.clamp(min=1.0), torch.ones_like(count)
    raise field_error(LossConfigError, "level", level, "has no batch normalization",
                      "use token or sequence")


def norm_factors(numerator: Tensor, denominator: Tensor) -> Tensor:
    """The divisor of each step's weights: its mean weight, or 1 where that mean is at or
    below ``NORM_FLOOR`` (an empty step, or weights all but zero). Example: ``([7, 0], [3, 0])``
    gives ``[7/3, 1]``."""
    mean = numerator / denominator.clamp(min=1.0)
    return torch.where(mean > NORM_FLOOR, mean, torch.ones_like(mean))


def _sample_sums(values: Tensor, sample_index: Tensor) -> Tensor:
    n = int(sample_index.max()) + 1 if sample_index.numel() else 0
    return torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(
        0, sample_index, values)
