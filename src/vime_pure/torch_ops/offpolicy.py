"""Off-policy correction on tensors: decoupled PPO's behaviour weights and step-level rejection.

Three policies meet in an off-policy token (decoupled PPO, Hilton et al. 2021): the *target*
``pi_theta`` being trained, the *old* (proximal) ``pi_old``, the trainer's weights when the
batch starts training (recomputed, never the engine's), and the *behaviour* ``pi_b``, the
engine weights that sampled the token (``rollout_log_probs``, possibly several syncs old).
Per token, with ``r = pi_theta / pi_old`` and ``w = pi_old / pi_b``::

    loss = w * max(-A * r, -A * clip(r, 1 - eps, 1 + eps_high))

``w`` is ``tis_weights(old, behaviour, cap=tis_clip, low=tis_clip_low)`` (``--use-tis``); the
clip anchors on ``pi_old``, so how far the behaviour policy lags never widens the trust
region. When every token is fresh and the engine matches the trainer, ``pi_old == pi_b``,
``w = 1`` and this is the on-policy PPO loss exactly.

Rejection (:func:`rejection_keep`, MIS / IcePop) zeroes tokens, or whole samples, whose
``pi_old / pi_b`` leaves a band. It is computed once per batch on whole samples, before
micro-batching (``vime_pure.data.rejection.with_rejection`` then applies it to the records,
with the ``original`` or ``surviving`` denominator), so like ``w`` it depends on nothing but
the token and its sample: the loss and its gradient stay invariant to how a step is split.

Example: ``old = log [0.5, 0.5]``, ``behaviour = log [0.25, 0.5]``: ``w = [2, 1]``; token
rejection with band ``[0.5, 1.5]`` keeps ``[0, 1]``.

slime's mis.py weights (levels, modes, batch normalization) live in ``vime_pure.torch_ops.mis``;
its rejection (``use_rs``, the veto) is :func:`rejection_keep`.
"""

import math

import torch
from jaxtyping import Float, Int
from torch import Tensor

from vime_pure.errors import LossConfigError, field_error
from vime_pure.policy_config import RejectionConfig
from vime_pure.torch_ops.boundary import tensor_boundary
from vime_pure.torch_ops.loss import rejection_mask


@tensor_boundary
def rejection_keep(old_log_probs: Float[Tensor, " t"], behaviour_log_probs: Float[Tensor, " t"],
                   loss_mask: Float[Tensor, " t"], sample_index: Int[Tensor, " t"],
                   config: RejectionConfig) -> Float[Tensor, " t"]:
    """1 for every token that survives ``config``'s test of ``pi_old / pi_b``, else 0.

    Tokens cover whole samples (``sample_index``: each token's sample), e.g. a batch's flat
    response tokens; tokens with loss mask 0 never vote in a sample's ratio and stay 1 unless
    their sample is dropped. Example: log-ratios ``[0, log 3, 0]``, samples ``[0, 0, 1]``,
    band ``[0.5, 2]``: token level ``[1, 0, 1]``; geometric ``[0, 0, 1]`` (sample 0's mean
    ratio is ``sqrt 3``).
    """
    if not isinstance(config, RejectionConfig):
        raise field_error(LossConfigError, "config", type(config).__name__,
                          "is not a RejectionConfig", "pass RejectionConfig(level=...)")
    log_ratio = old_log_probs.detach() - behaviour_log_probs.detach()
    ones = torch.ones_like(loss_mask)
    counted = loss_mask.detach() != 0
    if config.level == "token":
        keep = rejection_mask(log_ratio, ones, low=config.lower, high=config.upper)
    else:
        # Whole samples: masked tokens do not vote, so test the masked ratios, then spread the
        # verdict to every token of the sample.
        voted = rejection_mask(log_ratio, loss_mask, low=config.lower, high=config.upper,
                               sample_index=sample_index,
                               reduce="sum" if config.level == "sequence" else "mean")
        keep = ones * ~_any_per_sample(counted & (voted == 0), sample_index)
    if config.veto is not None:  # one catastrophic token drops its sample (mis.py's veto)
        vetoed = counted & (log_ratio < math.log(config.veto))
        keep = keep * ~_any_per_sample(vetoed, sample_index)
    return keep


def _any_per_sample(flags: Tensor, sample_index: Tensor) -> Tensor:
    """Per token: does any token of its sample carry ``flags``?"""
    n = int(sample_index.max()) + 1 if sample_index.numel() else 0
    hit = torch.zeros(n, dtype=torch.bool, device=sample_index.device).index_put_(
        (sample_index[flags],), torch.tensor(True, device=sample_index.device))
    return hit[sample_index]
