"""slime's mis.py importance weights (``--tis-function mis``) and the flags that choose them.

The core (``vime_pure.torch_ops.mis`` and the veto of ``rejection_keep``) is checked against
``reference``, a per-sample loop written from mis.py's algorithm in plain numpy: the level's
log-ratio, the safety bound, the three modes, token rejection and the veto, and batch
normalization over one batch. Hypothesis draws the batches. The flags: slime's mis.yaml through
``--custom-config-path`` (a file or miles' ``base64:``), the anchors' function paths, and the
errors for keys that would act on nothing.
"""

import base64
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vime_pure import BatchingPolicy, ParallelLayout, RolloutBatch
from vime_pure.data.batch import schedule_for
from vime_pure.data.microbatch import rank_batch
from vime_pure.data.rejection import with_is_weights
from vime_pure.data.sample import Sample
from vime_pure.errors import LossConfigError, RolloutBatchError
from vime_pure.policy_config import RS_LEVELS, TIS_MODES, MisConfig, RejectionConfig
from vime_pure.torch_ops.mis import mis_weights, norm_factors, norm_terms
from vime_pure.torch_ops.offpolicy import rejection_keep
from vime_pure.torch_ops.policy_loss import tis_weights
from vime_shell.settings.flags import parse_train_config
from vime_shell.settings.train_config import ConfigError

MIS_YAML = """use_tis: true
use_rs: true
tis_level: token
rs_level: token
tis_mode: truncate
tis_lower_bound: 0.5
tis_upper_bound: 2.0
rs_lower_bound: null
rs_upper_bound: null
rs_veto_threshold: 1.0e-4
tis_batch_normalize: true
"""
SLIME_MIS = "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"


def reference(samples, config: MisConfig, rs: RejectionConfig | None):
    """mis.py's compute_mis_weights, one sample at a time: (weights, masks) per sample, the
    weights batch-normalized over all ``samples`` when the config says so."""
    weights, masks = [], []
    for old, behaviour, mask in samples:
        r = old - behaviour
        level = {"token": r, "sequence": np.full_like(r, (r * mask).sum()),
                 "geometric": np.full_like(r, (r * mask).sum() / max(mask.sum(), 1.0))}
        w = np.exp(np.clip(level[config.level], -20, 20))
        new_mask = mask.copy()
        if config.mode == "truncate":
            out = np.minimum(w, config.upper) * mask
        elif config.mode == "clip":
            out = np.clip(w, config.lower, config.upper) * mask
        else:
            out = w * mask
            new_mask = new_mask * ((w >= config.lower) & (w <= config.upper))
        if rs is not None:
            rw = np.exp(np.clip(level[rs.level], -20, 20))
            new_mask = new_mask * ((rw >= rs.lower) & (rw <= rs.upper))
            if rs.veto is not None and ((r < math.log(rs.veto)) & (mask > 0)).any():
                new_mask = new_mask * 0.0
        weights.append(out)
        masks.append(new_mask)
    if config.batch_normalize:
        if config.level == "token":
            mean = sum((w * m).sum() for w, (_, _, m) in zip(weights, samples)) / max(
                sum(m.sum() for _, _, m in samples), 1.0)
        else:
            mean = np.mean([(w * m).sum() / max(m.sum(), 1.0)
                            for w, (_, _, m) in zip(weights, samples)])
        if mean > 1e-8:
            weights = [w / mean for w in weights]
    return weights, masks


def core(samples, config: MisConfig, rs: RejectionConfig | None):
    """The same through vime's core, on the flat tokens of all samples at once."""
    old, behaviour, mask = (torch.from_numpy(np.concatenate([s[i] for s in samples]))
                            for i in range(3))
    index = torch.from_numpy(np.repeat(np.arange(len(samples)), [len(s[0]) for s in samples]))
    out = mis_weights(old, behaviour, mask, index, config)
    weights, keep = out.weights, out.keep
    if rs is not None:
        keep = keep * rejection_keep(old, behaviour, mask, index, rs)
    if config.batch_normalize:
        num, den = norm_terms(weights, mask, index, config.level)
        weights = weights / norm_factors(num.sum()[None], den.sum()[None])[0]
    cuts = np.cumsum([len(s[0]) for s in samples])[:-1]
    return (np.split(weights.numpy(), cuts), np.split((keep * mask).numpy(), cuts))


@st.composite
def mis_batches(draw):
    n = draw(st.integers(1, 5))
    samples = []
    for _ in range(n):
        t = draw(st.integers(1, 6))
        behaviour = -np.array(draw(st.lists(st.floats(0.0, 4.0), min_size=t, max_size=t)))
        drift = np.array(draw(st.lists(st.floats(-1.5, 1.5), min_size=t, max_size=t)))
        mask = np.array(draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=t, max_size=t)))
        samples.append((behaviour + drift, behaviour, mask))
    level = draw(st.sampled_from(RS_LEVELS))
    config = MisConfig(level=level, mode=draw(st.sampled_from(TIS_MODES)), lower=0.5,
                       upper=draw(st.sampled_from([1.5, 2.0, 4.0])),
                       batch_normalize=level != "geometric" and draw(st.booleans()))
    rs = draw(st.none() | st.builds(
        RejectionConfig, level=st.sampled_from(RS_LEVELS), lower=st.just(0.4),
        upper=st.sampled_from([2.0, 3.0]), veto=st.sampled_from([None, 0.3])))
    return samples, config, rs


@settings(max_examples=150, deadline=None)
@given(mis_batches())
def test_the_core_equals_mis_py_step_for_step(drawn):
    samples, config, rs = drawn
    want_w, want_m = reference(samples, config, rs)
    got_w, got_m = core(samples, config, rs)
    for i, (gw, ww, gm, wm) in enumerate(zip(got_w, want_w, got_m, want_m)):
        np.testing.assert_allclose(gw, ww, rtol=1e-12, atol=1e-300, err_msg=f"sample {i}")
        np.testing.assert_array_equal(gm, wm, err_msg=f"sample {i}")
        assert np.isfinite(gw).all() and (gw >= 0).all()
        assert (gw[samples[i][2] == 0] == 0).all()  # a masked token weighs nothing


@settings(max_examples=60, deadline=None)
@given(mis_batches(), st.randoms(use_true_random=False))
def test_a_samples_weights_depend_on_its_own_tokens_only(drawn, rnd):
    """Without batch normalization, reordering the samples moves their weights with them:
    the weights cannot depend on how the step is split into micro-batches or ranks."""
    samples, config, rs = drawn
    config = MisConfig(level=config.level, mode=config.mode, lower=config.lower,
                       upper=config.upper)
    order = list(range(len(samples)))
    rnd.shuffle(order)
    w, m = core(samples, config, rs)
    w2, m2 = core([samples[i] for i in order], config, rs)
    for j, i in enumerate(order):
        np.testing.assert_array_equal(w2[j], w[i])
        np.testing.assert_array_equal(m2[j], m[i])


@settings(max_examples=60, deadline=None)
@given(mis_batches())
def test_the_mismatch_metrics_equal_mis_pys_per_sample(drawn):
    """add_ppl_metrics' values, per sample and spread over its tokens."""
    samples, config, _ = drawn
    old, behaviour, mask = (torch.from_numpy(np.concatenate([s[i] for s in samples]))
                            for i in range(3))
    index = torch.from_numpy(np.repeat(np.arange(len(samples)), [len(s[0]) for s in samples]))
    got = mis_weights(old, behaviour, mask, index, config).metrics
    at = 0
    for train, rollout, m in samples:
        n, mean = len(m), (lambda x, m=m: (x * m).sum() / max(m.sum(), 1.0))
        r = train - rollout
        want = {"training_log_ppl": -mean(train), "rollout_log_ppl": -mean(rollout),
                "log_ppl_diff": mean(rollout) - mean(train), "kl": rollout - train,
                "k3_kl": np.exp(r) - r - 1, "chi2_token": mean(np.exp(2 * r)) - 1,
                "chi2_seq": np.exp(2 * np.clip((r * m).sum(), -20, 20)) - 1}
        for key, value in want.items():
            np.testing.assert_allclose(got[key][at:at + n].numpy(),
                                       np.broadcast_to(value, (n,)), rtol=1e-9, atol=1e-12,
                                       err_msg=key)
        at += n


def test_the_module_docstring_example():
    old, behaviour = torch.tensor([math.log(3.0), 0.0]), torch.zeros(2)
    mask, index = torch.ones(2), torch.zeros(2, dtype=torch.long)
    out = mis_weights(old, behaviour, mask, index, MisConfig(mode="truncate", upper=2.0))
    assert out.weights.tolist() == pytest.approx([2.0, 1.0])
    out = mis_weights(old, behaviour, mask, index, MisConfig(mode="mask", lower=0.5, upper=2.0))
    assert out.weights.tolist() == pytest.approx([3.0, 1.0]) and out.keep.tolist() == [0, 1]
    assert out.metrics["tis_mask_fraction_high"].tolist() == [1.0, 0.0]


def test_the_veto_drops_the_whole_sample_of_one_catastrophic_token():
    """mis.py's rs_veto_threshold: a masked token with ratio below it drops its sample; a
    loss-masked-out token never vetoes."""
    old = torch.tensor([0.0, math.log(1e-5), 0.0, math.log(1e-5)])
    behaviour, index = torch.zeros(4), torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    config = RejectionConfig(level="token", lower=0.0, upper=1e6, veto=1e-4)
    assert rejection_keep(old, behaviour, mask, index, config).tolist() == [0, 0, 1, 1]


def test_batch_normalization_means_the_step_mean():
    weights = torch.tensor([2.0, 1.0, 4.0])
    mask, index = torch.ones(3), torch.tensor([0, 0, 1])
    num, den = norm_terms(weights, mask, index, "token")
    assert num.tolist() == [3.0, 4.0] and den.tolist() == [2.0, 1.0]
    num, den = norm_terms(weights, mask, index, "sequence")
    assert num.tolist() == [1.5, 4.0] and den.tolist() == [1.0, 1.0]
    assert norm_factors(torch.tensor([7.0, 0.0]), torch.tensor([3.0, 0.0])).tolist() == \
        pytest.approx([7 / 3, 1.0])


@pytest.mark.parametrize("kwargs, field", [
    (dict(level="geometric", batch_normalize=True), "batch_normalize"),
    (dict(mode="squash"), "mode"), (dict(level="sample"), "level"),
    (dict(lower=3.0, upper=2.0), "upper"), (dict(upper=0.0), "upper")])
def test_a_mis_config_that_cannot_work_is_refused_at_construction(kwargs, field):
    with pytest.raises(LossConfigError, match=f"^{field}="):
        MisConfig(**kwargs)


def test_a_veto_outside_0_1_is_refused():
    with pytest.raises(LossConfigError, match="^veto=2"):
        RejectionConfig(veto=2.0)


def test_the_records_take_their_weights_by_share_index():
    batch = RolloutBatch.from_samples([[Sample(tokens=[1, 2, 3, 4], response_length=2,
                                               loss_mask=[1, 1], reward=float(i))
                                        for i in range(2)] for _ in range(3)])
    schedule = schedule_for(batch, ParallelLayout(dp=1), BatchingPolicy(
        global_batch_size=3, max_tokens_per_gpu=8))
    rank = rank_batch(batch, schedule, dp_rank=0, loss_mode="group_token_mean")
    weights = np.arange(rank.num_response_tokens, dtype=np.float64)
    out = with_is_weights(rank, weights)
    for mb in out.microbatches:
        np.testing.assert_array_equal(mb.is_weights, weights[mb.share_index])
    with pytest.raises(RolloutBatchError, match="^weights="):
        with_is_weights(rank, -weights - 1)


# -- the flags ------------------------------------------------------------------------------
def test_slimes_mis_yaml_applies_over_the_flags(tmp_path):
    path = tmp_path / "mis.yaml"
    path.write_text(MIS_YAML)
    cfg = parse_train_config(["--use-tis", "--tis-upper-bound", "5", "--custom-config-path",
                              str(path), "--custom-tis-function-path", SLIME_MIS])
    assert cfg.tis_function == "mis" and cfg.tis_upper_bound == 2.0  # the file wins
    assert cfg.mis_config() == MisConfig(level="token", mode="truncate", lower=0.5, upper=2.0,
                                         batch_normalize=True)
    assert cfg.rejection_config() == RejectionConfig(level="token", lower=0.5, upper=2.0,
                                                     veto=1e-4)


def test_miles_inline_base64_config():
    inline = "base64:" + base64.b64encode(MIS_YAML.encode()).decode()
    cfg = parse_train_config(["--custom-config-path", inline, "--tis-function", "mis"])
    assert cfg.mis_config().batch_normalize and cfg.rejection_config().veto == 1e-4


def test_a_key_that_is_no_setting_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("use_tis: true\nmax_turns: 3\n")
    with pytest.raises(ConfigError, match="--custom-config-path .*c.yaml key='max_turns'"):
        parse_train_config(["--custom-config-path", str(path)])


@pytest.mark.parametrize("path, name", [
    ("slime.backends.megatron_utils.loss.icepop_function", "icepop"),
    ("miles.backends.training_utils.loss_hub.corrections.vanilla_tis_function", "vanilla"),
    ("examples.infra_features.train_infer_mismatch_helper.mis.compute_mis_weights_fsdp", "mis")])
def test_the_anchors_tis_function_paths_name_vimes(path, name):
    assert parse_train_config(["--use-tis", "--custom-tis-function-path", path]
                              ).tis_function == name


def test_a_mis_key_without_mis_is_an_error_not_ignored():
    with pytest.raises(ConfigError, match="^--tis-level='sequence': has no effect without "
                                          "--use-tis --tis-function mis"):
        parse_train_config(["--use-tis", "--tis-level", "sequence"])
    with pytest.raises(ConfigError, match="^--tis-batch-normalize=True: has no mean"):
        parse_train_config(["--use-tis", "--tis-function", "mis", "--tis-level", "geometric",
                            "--tis-batch-normalize"])


def test_a_tis_function_without_use_tis_or_a_bad_veto_names_its_flag():
    with pytest.raises(ConfigError, match="^--tis-function='mis': weighs the surrogate only "
                                          "under --use-tis"):
        parse_train_config(["--custom-tis-function-path", SLIME_MIS])
    with pytest.raises(ConfigError, match="^--rs-veto-threshold=1.0: must lie in"):
        parse_train_config(["--use-rs", "--rs-veto-threshold", "1"])


def test_mismatch_metrics_alone_need_mis_and_no_use_tis():
    cfg = parse_train_config(["--get-mismatch-metrics", "--tis-function", "mis"])
    assert cfg.mis_config() == MisConfig() and not cfg.use_tis
    with pytest.raises(ConfigError, match="^--get-mismatch-metrics=True: computes mis.py's"):
        parse_train_config(["--get-mismatch-metrics"])


def test_icepop_zeroes_the_ratios_outside_the_band():
    old = torch.log(torch.tensor([3.0, 1.5, 0.1]))
    got = tis_weights(old, torch.zeros(3), cap=2.0, low=0.5, icepop=True)
    assert got.tolist() == pytest.approx([0.0, 1.5, 0.0])
