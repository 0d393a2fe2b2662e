"""Per-token policy-loss pieces: PPO/GRPO clipped surrogate, KL penalty (k1, k2, k3, low_var_kl), entropy.

Every function maps per-token tensors to per-token tensors of the same length and never
reduces: aggregation belongs to ``vime_pure.torch_ops.loss.microbatch_loss`` with step-level
denominators, so a loss computed here stays invariant to how a step is split. GRPO is the same
surrogate fed with group-normalised advantages.

Formulas (``r = exp(clamp(logp - old_logp, -20, 20))``, advantage ``A``):
  * surrogate ``pg = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))``; with dual clip
    ``c > 1`` and ``A < 0`` it is further capped at ``-A * c``;
  * GSPO (``surrogate="gspo"``): every token of sample ``i`` uses the sequence ratio
    ``s_i = exp(mean_{t in i, m_t = 1}(logp_t - old_t))``, the geometric mean of its token
    ratios, so the clip acts on whole sequences (:func:`gspo_clip_loss`); under context
    parallelism the mean's sums are reduced over the CP group first;
  * CISPO (``surrogate="cispo"``, MiniMax-M1): ``pg = -sg(clip(r, 1 - eps_low, 1 + eps_high))
    * A * logp``: the clipped ratio only weights the log-prob's gradient, so a clipped token
    still learns (:func:`cispo_loss`);
  * ``k1 = logp - ref_logp``; ``k2 = k1**2 / 2``;
    ``k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1 >= 0`` (``low_var_kl``: clamped to 10);
  * entropy ``H = -sum_v softmax(z)_v * log_softmax(z)_v``;
  * ``total = tis * pg + kl_coef * kl - entropy_coef * H``;
  * supervised fine-tuning (``--loss-type sft_loss``): ``total = -logp`` (:func:`sft_terms`).

Invariants the tests assert: at ``r = 1`` the surrogate is ``-A`` with zero clip fraction
(CISPO's gradient is then the PPO surrogate's);
``k3 >= 0`` and ``k1 = k3 = 0`` when ``logp == ref_logp``; entropy of uniform logits over
``V`` is ``log V``.
"""


from collections.abc import Callable

import attrs
import torch
from jaxtyping import Float, Int
from torch import Tensor

from vime_pure.errors import LossConfigError, field_error
from vime_pure.policy_config import KL_KINDS, KLKind, check_loss_knob, check_surrogate
from vime_pure.torch_ops.boundary import tensor_boundary



LOG_RATIO_LIMIT = 20.0


@attrs.frozen
class PolicyTerms:
    """Per-token pieces of one packed row; reduce each with ``microbatch_loss``.

    ``total`` is differentiated; the others are detached for reporting (``clipped`` is 1.0
    where the clip was active, so its reduction is the clip fraction).
    """

    total: Float[Tensor, " t"]
    pg: Float[Tensor, " t"]
    kl: Float[Tensor, " t"]
    entropy: Float[Tensor, " t"]
    clipped: Float[Tensor, " t"]
    ratio: Float[Tensor, " t"]


def _ratio_and_band(log_probs: Tensor, old_log_probs: Tensor, eps_clip: float | int,
                    eps_clip_high: float | int | None) -> tuple[Tensor, float, float]:
    """The importance ratio ``r`` and its clip band ``[1 - eps_clip, 1 + eps_clip_high]``, the
    knobs checked against ``LOSS_BOUNDS`` (their one home: a direct caller gets LossConfig's
    check). The log-ratio is clamped to [-20, 20] (as verl does): exp(89) overflows float32
    to inf, and inf * (A = 0) is a NaN; a ratio past e**20 is far outside any band anyway."""
    eps_clip = check_loss_knob("eps_clip", eps_clip)
    high = eps_clip if eps_clip_high is None else check_loss_knob("eps_clip_high", eps_clip_high)
    ratio = torch.exp((log_probs - old_log_probs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    return ratio, 1.0 - eps_clip, 1.0 + high


@tensor_boundary
def ppo_clip_loss(log_probs: Float[Tensor, " t"], old_log_probs: Float[Tensor, " t"],
                  advantages: Float[Tensor, " t"], *, eps_clip: float | int = 0.2,
                  eps_clip_high: float | int | None = None, dual_clip: float | int | None = None
                  ) -> tuple[Float[Tensor, " t"], Float[Tensor, " t"], Float[Tensor, " t"]]:
    """Clipped surrogate per token: ``(loss, clipped, ratio)``.

    Example: ``logp - old = log(1.5)``, ``A = 1``, eps 0.2: ratio 1.5 is clipped to 1.2, so the
    loss is ``-1.2`` and ``clipped = 1``.
    """
    ratio, low, high = _ratio_and_band(log_probs, old_log_probs, eps_clip, eps_clip_high)
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(low, high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = (clipped_loss > unclipped).to(log_probs.dtype)
    if dual_clip is not None:
        dual_clip = check_loss_knob("dual_clip", dual_clip)
        capped = torch.minimum(loss, -advantages * dual_clip)
        loss = torch.where(advantages < 0, capped, loss)
    return loss, clipped.detach(), ratio.detach()


@tensor_boundary
def gspo_clip_loss(log_probs: Float[Tensor, " t"], old_log_probs: Float[Tensor, " t"],
                   advantages: Float[Tensor, " t"], loss_mask: Float[Tensor, " t"],
                   sample_index: Int[Tensor, " t"], *, eps_clip: float | int = 0.2,
                   eps_clip_high: float | int | None = None,
                   dual_clip: float | int | None = None, num_samples: int | None = None,
                   reduce: Callable[[Tensor], Tensor] | None = None
                   ) -> tuple[Float[Tensor, " t"], Float[Tensor, " t"], Float[Tensor, " t"]]:
    """GSPO's sequence-level clipped surrogate, per token: ``(loss, clipped, ratio)``.

    Sample ``i``'s ratio is ``s_i = exp(sum_t m_t (logp_t - old_t) / sum_t m_t)`` over its
    tokens (``sample_index``), differentiable in ``logp``; each of its tokens then carries the
    clipped surrogate of ``s_i`` (:func:`ppo_clip_loss` on the sequence log-ratio), so a loss
    mode's per-sample token average is GSPO's per-sequence term.

    A row holds whole samples, or under context parallelism each CP rank a slice of every
    sample of the same row (``vime_pure.cp``): ``reduce`` then sums the per-sample
    ``(sums, counts)``, a ``(2, num_samples)`` tensor, over the CP group (differentiably: the
    shell's all-reduce), so every rank uses the whole sample's ratio and the CP ranks' losses
    add up to the CP = 1 loss. ``num_samples``: the row's samples (default: from
    ``sample_index``; give it under CP, where a rank's slice may miss a sample's tokens).

    At ``logp == old`` value and gradient equal the token-level surrogate's: ``ds_i/dlogp_t =
    m_t / n_i`` and the ``n_i`` tokens' weights ``m / D_i`` sum back to ``1 / D_i`` per token.
    Example: one sample with log-ratios ``log 2`` and ``0``: ``s = sqrt 2 = 1.414``, clipped to
    1.2 at eps 0.2 for ``A = 1``: both tokens carry ``-1.2``; the token-level surrogate would
    clip the first token only.
    """
    if num_samples is None:
        num_samples = int(sample_index.max()) + 1 if sample_index.numel() else 0
    mask = loss_mask.to(log_probs.dtype)
    zeros = torch.zeros((2, num_samples), dtype=log_probs.dtype, device=log_probs.device)
    parts = torch.stack([(log_probs - old_log_probs) * mask, mask])
    sums = zeros.index_add(1, sample_index, parts)
    if reduce is not None:
        sums = reduce(sums)
    sequence_log_ratio = (sums[0] / sums[1].clamp(min=1.0))[sample_index]
    return ppo_clip_loss(sequence_log_ratio, torch.zeros_like(sequence_log_ratio), advantages,
                         eps_clip=eps_clip, eps_clip_high=eps_clip_high, dual_clip=dual_clip)


@tensor_boundary
def cispo_loss(log_probs: Float[Tensor, " t"], old_log_probs: Float[Tensor, " t"],
               advantages: Float[Tensor, " t"], *, eps_clip: float | int = 0.2,
               eps_clip_high: float | int | None = None
               ) -> tuple[Float[Tensor, " t"], Float[Tensor, " t"], Float[Tensor, " t"]]:
    """CISPO's surrogate per token (MiniMax-M1, arXiv 2506.13585, eq. 4-5):
    ``(loss, clipped, ratio)`` with ``loss = -sg(clip(r, 1 - eps_clip, 1 + eps_clip_high)) *
    A * logp``. The gradient is ``-clip(r) * A`` on ``logp`` alone, also where the clip acts
    (PPO's is 0 there); ``eps_clip = 1`` disables the lower bound (the paper's setting).

    Example: ``r = 1.5``, ``A = 1``, ``logp = -0.7``, eps 0.2: the weight is 1.2, the loss
    ``0.84``, its gradient ``-1.2``, and ``clipped = 1``.
    """
    ratio, low, high = _ratio_and_band(log_probs, old_log_probs, eps_clip, eps_clip_high)
    weight = ratio.clamp(low, high).detach()
    clipped = (weight != ratio.detach()).to(log_probs.dtype)
    return -weight * advantages * log_probs, clipped, ratio.detach()


@tensor_boundary
def kl_penalty(log_probs: Float[Tensor, " t"], ref_log_probs: Float[Tensor, " t"],
               kind: KLKind | str = "k3") -> Float[Tensor, " t"]:
    """Per-token KL estimate of the policy from the reference (Schulman's estimators).

    With ``d = logp - ref``: ``k1 = d``; ``k2 = d**2 / 2``; ``k3 = exp(-d) + d - 1 >= 0``;
    ``low_var_kl`` is ``k3`` clamped to ``[-10, 10]`` (slime's and verl's name).
    Example: ``logp = log(0.5)``, ``ref = log(0.25)``: k1 = log 2 = 0.693, k2 = 0.240,
    k3 = 0.5 - log(0.5) - 1 = 0.193.
    """
    log_ratio = ref_log_probs - log_probs
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio * log_ratio
    if kind in ("k3", "low_var_kl"):
        k3 = torch.exp(log_ratio) - log_ratio - 1.0
        return k3.clamp(-10.0, 10.0) if kind == "low_var_kl" else k3
    raise field_error(LossConfigError, "kind", kind, "is not a KL estimator",
                      f"use one of {KL_KINDS}")


@tensor_boundary
def entropy_from_logits(logits: Float[Tensor, "t v"]) -> Float[Tensor, " t"]:
    """Per-token entropy of the softmax of ``logits``. Example: uniform over 4 -> log 4."""
    log_p = torch.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)


@tensor_boundary
def token_log_probs(logits: Float[Tensor, "t v"], targets: Int[Tensor, " t"]
                    ) -> Float[Tensor, " t"]:
    """Log-probability of each target under its row of logits (logit ``t`` scores token t+1).

    A target outside ``[0, V)`` is a ``LossConfigError`` (one host sync), not a gather error.
    """
    vocab = logits.shape[-1]
    if targets.numel() and bool(((targets < 0) | (targets >= vocab)).any()):
        i = int(torch.nonzero((targets < 0) | (targets >= vocab))[0, 0])
        raise field_error(LossConfigError, f"targets[{i}]", int(targets[i]),
                          f"is outside the vocabulary [0, {vocab})",
                          "pass token ids of the model's vocabulary")
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]


@tensor_boundary
def tis_weights(old_log_probs: Float[Tensor, " t"], rollout_log_probs: Float[Tensor, " t"], *,
                cap: float | int = 2.0, low: float | int = 0.0, icepop: bool = False
                ) -> Float[Tensor, " t"]:
    """Truncated importance weights ``clamp(exp(old - rollout), low, cap)``, detached; with
    ``icepop`` (slime's ``icepop_function``) the ratio itself inside ``[low, cap]``, else 0.

    Decoupled PPO's behaviour weight ``pi_old / pi_behaviour`` (slime's ``--tis-clip`` is
    ``cap``, ``--tis-clip-low`` is ``low``; ``vime_pure.torch_ops.offpolicy``); the rejection
    alternative is ``vime_pure.torch_ops.loss.rejection_mask``. Example: ratios ``[3.0, 0.1]``
    with cap 2 and low 0.5 -> ``[2.0, 0.5]``; with ``icepop`` ``[0, 0]``.
    """
    cap = check_loss_knob("tis_clip", cap, field="cap")
    low = check_loss_knob("tis_clip_low", low, field="low")
    if low > cap:  # LossConfig's relational rule, for a direct caller
        raise field_error(LossConfigError, "low", low, f"must be at most cap={cap}",
                          "pass e.g. low=0 (no lower clamp) or 0.5")
    top = torch.finfo(old_log_probs.dtype).max
    if low > top:  # no weight of this dtype could reach it
        raise field_error(LossConfigError, "low", low,
                          f"is past the largest {old_log_probs.dtype} value",
                          "pass e.g. low=0 (no lower clamp) or 0.5")
    # A cap past the dtype's largest value truncates nothing (and torch refuses to convert it).
    cap = min(cap, top)
    ratio = torch.exp((old_log_probs - rollout_log_probs).clamp(max=LOG_RATIO_LIMIT)).detach()
    if icepop:
        return torch.where((ratio >= low) & (ratio <= cap), ratio, torch.zeros_like(ratio))
    return ratio.clamp(min=low, max=cap)


@tensor_boundary
def kl_shaped_advantages(advantages: Float[Tensor, " t"], old_log_probs: Float[Tensor, " t"],
                         ref_log_probs: Float[Tensor, " t"], *, coef: float | int,
                         kind: KLKind | str = "low_var_kl") -> Float[Tensor, " t"]:
    """slime's reward-shaping KL (``--kl-coef``) for REINFORCE++-baseline: each token's
    advantage minus ``coef`` times the KL estimate of the policy that generated it (pi_old)
    from the reference, with no gradient (it is part of the reward, not of the loss).
    Example: ``A = 1``, ``old = log 0.5``, ``ref = log 0.25``, k1, ``coef = 0.1``:
    ``1 - 0.1 * log 2 = 0.931``.
    """
    coef = check_loss_knob("reward_kl_coef", coef)
    if coef == 0.0:
        return advantages
    return advantages - coef * kl_penalty(old_log_probs.detach(), ref_log_probs, kind).detach()


@tensor_boundary
def policy_loss(log_probs: Float[Tensor, " t"], old_log_probs: Float[Tensor, " t"],
                advantages: Float[Tensor, " t"], *, entropy: Float[Tensor, " t"] | None = None,
                ref_log_probs: Float[Tensor, " t"] | None = None, kl_coef: float | int = 0.0,
                kl_kind: KLKind | str = "k3", entropy_coef: float | int = 0.0,
                eps_clip: float | int = 0.2,
                eps_clip_high: float | int | None = None, dual_clip: float | int | None = None,
                tis: Float[Tensor, " t"] | None = None, surrogate: str = "ppo",
                loss_mask: Float[Tensor, " t"] | None = None,
                sample_index: Int[Tensor, " t"] | None = None, num_samples: int | None = None,
                reduce: Callable[[Tensor], Tensor] | None = None) -> PolicyTerms:
    """All per-token pieces and their weighted total (see the module formulas).

    ``surrogate``: ``ppo``, ``gspo`` (:func:`gspo_clip_loss`, which needs the row's
    ``loss_mask`` and ``sample_index``, and under CP ``num_samples`` and the CP ``reduce``) or
    ``cispo`` (:func:`cispo_loss`; no dual clip: its loss is not PPO's).
    Example: ``r = 1``, ``A = 2``, no KL/entropy terms: ``total = pg = -2`` per token.
    """
    kl_coef = check_loss_knob("kl_coef", kl_coef)
    entropy_coef = check_loss_knob("entropy_coef", entropy_coef)
    pg, clipped, ratio = _surrogate(log_probs, old_log_probs, advantages, surrogate,
                                    eps_clip=eps_clip, eps_clip_high=eps_clip_high,
                                    dual_clip=dual_clip, loss_mask=loss_mask,
                                    sample_index=sample_index, num_samples=num_samples,
                                    reduce=reduce)
    if tis is not None:
        pg = pg * tis
    zeros = torch.zeros_like(log_probs)
    if kl_coef != 0.0 and ref_log_probs is None:
        raise field_error(LossConfigError, "ref_log_probs", None,
                          f"is required when kl_coef={kl_coef}", "pass reference log-probs")
    # With reference log-probs the KL is computed (and reported) even at coefficient 0.
    kl = zeros if ref_log_probs is None else kl_penalty(log_probs, ref_log_probs, kl_kind)
    ent = zeros if entropy is None else entropy
    if entropy_coef != 0.0 and entropy is None:
        raise field_error(LossConfigError, "entropy", None,
                          f"is required when entropy_coef={entropy_coef}",
                          "pass entropy_from_logits(logits)")
    total = pg + kl_coef * kl - entropy_coef * ent
    return PolicyTerms(total=total, pg=pg.detach(), kl=kl.detach(), entropy=ent.detach(),
                       clipped=clipped, ratio=ratio)


@tensor_boundary
def sft_terms(log_probs: Float[Tensor, " t"], *, entropy: Float[Tensor, " t"] | None = None
              ) -> PolicyTerms:
    """Supervised fine-tuning's per-token pieces: ``total = pg = -logp`` (the negative
    log-likelihood; a loss mode's reduction over the loss-masked tokens makes it slime's
    ``sft_loss``), no ratio (reported as 1), no clip, no KL; the entropy is reported.
    Example: ``logp = log 0.5`` gives ``total = 0.693`` per token."""
    zeros = torch.zeros_like(log_probs)
    return PolicyTerms(total=-log_probs, pg=-log_probs.detach(), kl=zeros,
                       entropy=zeros if entropy is None else entropy.detach(), clipped=zeros,
                       ratio=torch.ones_like(log_probs).detach())


def _surrogate(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, surrogate: str,
               *, eps_clip: float | int, eps_clip_high: float | int | None,
               dual_clip: float | int | None, loss_mask: Tensor | None,
               sample_index: Tensor | None, num_samples: int | None,
               reduce: Callable[[Tensor], Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
    """The policy-gradient term ``(pg, clipped, ratio)`` of ``surrogate``."""
    check_surrogate(surrogate, dual_clip)
    if surrogate == "gspo":
        if loss_mask is None or sample_index is None:
            raise field_error(LossConfigError, "surrogate", surrogate,
                              "needs the row's loss_mask and sample_index",
                              "pass loss_mask= and sample_index= (the record's token_sample)")
        return gspo_clip_loss(log_probs, old_log_probs, advantages, loss_mask, sample_index,
                              eps_clip=eps_clip, eps_clip_high=eps_clip_high,
                              dual_clip=dual_clip, num_samples=num_samples, reduce=reduce)
    if surrogate == "cispo":
        return cispo_loss(log_probs, old_log_probs, advantages, eps_clip=eps_clip,
                          eps_clip_high=eps_clip_high)
    return ppo_clip_loss(log_probs, old_log_probs, advantages, eps_clip=eps_clip,
                         eps_clip_high=eps_clip_high, dual_clip=dual_clip)
