"""Fuzz: the denominator functions, the Megatron scale, ``LossConfig`` and the torch loss
pieces, on valid and invalid inputs (wrong types, NaN, inf, negative and out-of-range values,
masks other than 0/1, mismatched lengths).

Success must give the documented numbers (checked against plain-Python references) and never
a NaN a caller did not pass in; failure a ``VimeError``.
"""

import math
from collections import defaultdict

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.harness import REJECTED, canonical_groups, close, no_nan, outcome
from tests.fuzz.strategies import (BAD_REALS, JUNK, bad_id_lists, bad_ints, bad_masks, good_ints,
                                   good_reals, id_lists, masks, mostly, one_bad, reals)
from vime_pure import (LOSS_MODES, LossConfig, group_mask_sums, megatron_loss_scale,
                       sample_denominators, step_denominators)
from vime_pure.torch_ops import (entropy_from_logits, kl_penalty, microbatch_loss, policy_loss,
                                 ppo_clip_loss, rejection_mask, tis_weights, token_log_probs)

MODE = st.sampled_from(LOSS_MODES)
BAD_MODE = st.one_of(st.text(max_size=3), JUNK)


def _group_totals(group_ids, loss_masks) -> list[float]:
    groups = canonical_groups(group_ids)
    total = defaultdict(float)
    for g, m in zip(groups, loss_masks):
        total[g] += float(np.sum(m))
    return [total[g] for g in groups]


@st.composite
def mask_inputs(draw, rejection: bool = False):
    """Keyword arguments of ``group_mask_sums`` (and, with ``rejection``, of
    ``sample_denominators``), at most one of them bad."""
    n = draw(st.integers(0, 8))
    valid = {"group_ids": id_lists(n), "loss_masks": masks(n)}
    bad = {"group_ids": bad_id_lists(n), "loss_masks": bad_masks(n)}
    if rejection:
        valid |= {"mode": MODE, "norm": st.none() | good_reals(1, 100),
                  "denominator": st.sampled_from(["original", "surviving"])}
        bad |= {"mode": BAD_MODE, "norm": BAD_REALS,
                "denominator": st.one_of(st.text(max_size=3), JUNK)}
    kwargs = draw(one_bad(valid, bad))
    if rejection and isinstance(kwargs["loss_masks"], list) and draw(st.booleans()):
        shapes = [len(m) if hasattr(m, "__len__") else 0 for m in kwargs["loss_masks"]]
        ok = [draw(st.lists(st.sampled_from([0, 1]), min_size=k, max_size=k)) for k in shapes]
        kwargs["rejection_masks"] = draw(mostly(st.just(ok), st.one_of(
            bad_masks(len(ok)), st.just([m + [1] for m in ok]))))  # one value too many
    return kwargs


@given(mask_inputs())
def test_group_mask_sums(kwargs):
    sums = outcome("group_mask_sums", group_mask_sums, **kwargs)
    if sums is not REJECTED:
        no_nan(sums)
        assert sums.tolist() == _group_totals(kwargs["group_ids"], kwargs["loss_masks"])


@given(mask_inputs(rejection=True))
def test_sample_denominators(kwargs):
    dens = outcome("sample_denominators", sample_denominators, **kwargs)
    if dens is not REJECTED:
        no_nan(dens)
        assert (dens >= 0).all() and np.isfinite(dens).all()
        if kwargs["mode"] == "group_token_mean" and (
                kwargs.get("rejection_masks") is None or kwargs["denominator"] == "original"):
            assert dens.tolist() == _group_totals(kwargs["group_ids"], kwargs["loss_masks"])


@st.composite
def step_columns(draw):
    """The three per-sample columns, as arrays or lists; half the time one corrupted: a bad
    value (NaN, negative, out of range), a wrong type or a wrong length."""
    n = draw(st.integers(0, 8))
    groups = draw(st.lists(st.integers(0, max(n - 1, 0)), min_size=n, max_size=n))
    sums = draw(st.lists(st.integers(0, 6).map(float), min_size=n, max_size=n))
    steps = draw(st.lists(st.integers(-1, max(n - 1, 0)), min_size=n, max_size=n))
    columns = [np.asarray(groups, dtype=np.int64), np.asarray(sums), np.asarray(steps)]
    if draw(st.booleans()):
        columns = [c.tolist() for c in columns]
    if n and draw(st.booleans()):
        k = draw(st.integers(0, 2))
        bad = draw(st.sampled_from(["value", "type", "length"]))
        if bad == "value":
            column = np.asarray(columns[k], dtype=np.float64)
            column[draw(st.integers(0, n - 1))] = draw(st.sampled_from(
                [float("nan"), -5.0, 1e300, float(n)]))
            columns[k] = column if k == 1 or draw(st.booleans()) else column.astype(np.int64)
        elif bad == "type":
            columns[k] = draw(JUNK)
        else:
            columns[k] = columns[k][:-1]
    return columns


@given(mostly(MODE, BAD_MODE), step_columns(), st.none() | reals(1, 50))
def test_step_denominators(mode, columns, norm):
    dens = outcome("step_denominators", step_denominators, mode, *columns, norm=norm)
    if dens is not REJECTED:
        steps = np.asarray(columns[2])
        # NaN marks exactly the untrained samples (documented: any use of it shows).
        assert np.array_equal(np.isnan(dens), steps < 0)
        assert (dens[steps >= 0] >= 0).all() and np.isfinite(dens[steps >= 0]).all()


@given(one_bad({"mode": MODE, "num_microbatches": good_ints(1, 8), "num_groups": good_ints(1, 8),
                "dp": good_ints(1, 4), "cp": good_ints(1, 2), "num_samples": good_ints(1, 9),
                "path": st.sampled_from(["pair", "triple", "per_token"]),
                "total_num_tokens": good_ints(0, 999)},
               {"mode": BAD_MODE, "num_microbatches": bad_ints(1), "num_groups": bad_ints(1),
                "dp": bad_ints(1), "cp": bad_ints(1), "num_samples": bad_ints(1),
                "total_num_tokens": bad_ints(0)}))
def test_megatron_loss_scale(kwargs):
    scale = outcome("megatron_loss_scale", megatron_loss_scale, **kwargs)
    if scale is not REJECTED:
        assert isinstance(scale, float) and math.isfinite(scale) and scale >= 0


@given(one_bad({"eps_clip": good_reals(0.01, 0.99),
                "eps_clip_high": st.none() | good_reals(0.01, 5),
                "dual_clip": st.none() | good_reals(1.1, 10), "kl_coef": good_reals(0, 1),
                "kl_kind": st.sampled_from(["k1", "k2", "k3", "low_var_kl"]),
                "entropy_coef": good_reals(0, 1), "use_tis": st.booleans(),
                "tis_clip": good_reals(0.5, 5)},
               {name: BAD_REALS for name in ("eps_clip", "eps_clip_high", "dual_clip", "kl_coef",
                                             "entropy_coef", "tis_clip")}))
def test_loss_config(kwargs):
    cfg = outcome("LossConfig", LossConfig, **kwargs)
    if cfg is not REJECTED:
        for name in ("eps_clip", "kl_coef", "entropy_coef"):
            assert math.isfinite(getattr(cfg, name))


@st.composite
def rows(draw):
    """A packed row: per-token values, mask, token->sample index, per-sample D; sometimes one
    of them corrupted (a 0.5 or NaN mask, a negative or too-large index, a D of 0 / -1 / NaN
    under a non-zero mask, a wrong length or dtype)."""
    s = draw(st.integers(1, 4))
    t = draw(st.integers(0, 10))
    x = torch.tensor(draw(st.lists(st.floats(-100, 100), min_size=t, max_size=t)),
                     dtype=torch.float64)
    mask = torch.tensor(draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=t, max_size=t)),
                        dtype=torch.float64)
    index = torch.tensor(draw(st.lists(st.integers(0, s - 1), min_size=t, max_size=t)),
                         dtype=torch.int64)
    dens = torch.tensor(draw(st.lists(st.integers(1, 20).map(float), min_size=s, max_size=s)),
                        dtype=torch.float64)
    row = {"x": x, "mask": mask, "index": index, "dens": dens}
    bad = draw(mostly(st.none(), st.sampled_from(["mask", "index", "dens", "length", "dtype",
                                                   "junk"])))
    if bad == "mask" and t:
        row["mask"] = mask.clone()
        row["mask"][draw(st.integers(0, t - 1))] = draw(st.sampled_from([0.5, 2.0, float("nan")]))
    elif bad == "index" and t:
        row["index"] = index.clone()
        row["index"][draw(st.integers(0, t - 1))] = draw(st.sampled_from([-1, s, 10**6]))
    elif bad == "dens":
        row["dens"] = dens.clone()
        row["dens"][draw(st.integers(0, s - 1))] = draw(st.sampled_from(
            [0.0, -1.0, float("nan"), float("inf")]))
    elif bad == "length":
        key = draw(st.sampled_from(["x", "mask", "index"]))
        row[key] = torch.cat([row[key], row[key][:1] if t else row[key].new_zeros(1)])
    elif bad == "dtype":
        key = draw(st.sampled_from(["x", "mask", "index", "dens"]))
        row[key] = row[key].to(torch.int64 if row[key].is_floating_point() else torch.float64)
    elif bad == "junk":
        row[draw(st.sampled_from(["x", "mask", "index", "dens"]))] = draw(JUNK)
    return row


@given(rows())
def test_microbatch_loss(row):
    value = outcome("microbatch_loss", microbatch_loss, row["x"], row["mask"], row["index"],
                    row["dens"])
    if value is not REJECTED:
        no_nan(value)
        expected = sum(float(row["x"][t]) * float(row["mask"][t]) /
                       float(row["dens"][row["index"][t]]) for t in range(len(row["x"]))
                       if row["mask"][t] != 0)
        assert close(float(value), expected)


@given(rows(), mostly(good_reals(0, 1), BAD_REALS), mostly(good_reals(1, 4), BAD_REALS),
       st.booleans())
def test_rejection_mask(row, low, high, per_sample):
    index = row["index"] if per_sample else None
    log_ratio = row["x"] / 50 if isinstance(row["x"], torch.Tensor) else row["x"]
    kept = outcome("rejection_mask", rejection_mask, log_ratio, row["mask"], low=low,
                   high=high, sample_index=index)
    if kept is not REJECTED:
        no_nan(kept)
        assert set(kept.tolist()) <= {0.0, 1.0}
        assert bool((kept <= row["mask"]).all())  # rejection only removes tokens


@st.composite
def token_tensors(draw, count: int = 3):
    """``count`` per-token float tensors of one length (sometimes NaN/inf, or one too long)."""
    t = draw(st.integers(0, 6))
    values = st.floats(allow_nan=True) if draw(st.integers(0, 4)) == 4 else st.floats(-5, 5)
    out = [torch.tensor(draw(st.lists(values, min_size=t, max_size=t)), dtype=torch.float32)
           for _ in range(count)]
    if draw(st.integers(0, 5)) == 5:  # one tensor one token too long
        out[draw(st.integers(0, count - 1))] = torch.zeros(t + 1)
    return out


@given(token_tensors(), one_bad({"eps_clip": good_reals(0, 0.5),
                                 "eps_clip_high": st.none() | good_reals(0, 1),
                                 "dual_clip": st.none() | good_reals(1.01, 5)},
                                {name: BAD_REALS for name in ("eps_clip", "eps_clip_high",
                                                              "dual_clip")}))
def test_ppo_clip_loss(tensors, kwargs):
    out = outcome("ppo_clip_loss", ppo_clip_loss, *tensors, **kwargs)
    if out is not REJECTED and all(bool(torch.isfinite(t).all()) for t in tensors):
        loss, clipped, _ = out
        no_nan(loss)
        assert set(clipped.tolist()) <= {0.0, 1.0}


@given(token_tensors(2), mostly(st.sampled_from(["k1", "k2", "k3", "low_var_kl"]), BAD_MODE))
def test_kl_penalty(tensors, kind):
    kl = outcome("kl_penalty", kl_penalty, *tensors, kind)
    if kl is not REJECTED and all(bool(torch.isfinite(t).all()) for t in tensors):
        no_nan(kl)
        if kind in ("k3", "low_var_kl"):
            assert bool((kl >= -1e-6).all())


@given(token_tensors(2), reals(0.1, 10), reals(0, 0.1))
def test_tis_weights(tensors, cap, low):
    w = outcome("tis_weights", tis_weights, *tensors, cap=cap, low=low)
    if w is not REJECTED and all(bool(torch.isfinite(t).all()) for t in tensors):
        no_nan(w)
        assert bool((w >= float(low)).all()) and bool((w <= float(cap)).all())


@given(token_tensors(5), one_bad({"kl_coef": good_reals(0, 1), "entropy_coef": good_reals(0, 1),
                                  "with_ref": st.booleans(), "with_entropy": st.booleans()},
                                 {"kl_coef": BAD_REALS, "entropy_coef": BAD_REALS}))
def test_policy_loss(tensors, kwargs):
    logp, old, adv, ref, ent = tensors
    terms = outcome("policy_loss", policy_loss, logp, old, adv, kl_coef=kwargs["kl_coef"],
                    entropy_coef=kwargs["entropy_coef"], kl_kind="low_var_kl",
                    ref_log_probs=ref if kwargs["with_ref"] is True else None,
                    entropy=ent if kwargs["with_entropy"] is True else None)
    if terms is not REJECTED and all(bool(torch.isfinite(t).all()) for t in tensors):
        no_nan(terms.total)


@given(st.integers(0, 5), st.integers(1, 6), st.data())
def test_token_log_probs_and_entropy(t, v, data):
    logits = torch.tensor(data.draw(st.lists(st.lists(st.floats(-20, 20), min_size=v, max_size=v),
                                             min_size=t, max_size=t)), dtype=torch.float32)
    logits = logits.reshape(t, v)
    targets = torch.tensor(data.draw(st.lists(mostly(st.integers(0, v - 1), st.sampled_from(
        [-1, v, 10**6])), min_size=t, max_size=t)), dtype=torch.int64)
    logps = outcome("token_log_probs", token_log_probs, logits, targets)
    if logps is not REJECTED:
        no_nan(logps)
        assert bool((logps <= 1e-6).all())
    entropy = outcome("entropy_from_logits", entropy_from_logits, logits)
    if entropy is not REJECTED:
        no_nan(entropy)
        assert bool((entropy >= -1e-5).all()) and bool((entropy <= math.log(v) + 1e-4).all())
