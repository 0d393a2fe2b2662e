"""Multi-token prediction trained beside the policy (slime's ``--enable-mtp-training``,
``vime_shell.megatron.mtp``), on a tiny GLM-4.7-Flash and a tiny GLM-4.5 MoE with one
DeepSeek-V3-style MTP layer each, and a tiny MiMo (its MTP layer under MiMo's names,
``input_proj`` over ``[hidden, embedding]``).

Asserted: the first step's MTP loss is the checkpoint's MTP module computed in transformers'
own layers (1e-6), for each: the layer is built, named, loaded and run as the checkpoint
means it. Only the MTP layers learn from it: every other parameter's gradient equals the run
without MTP training, and the MTP layers' gradients are not zero. The loss does not depend on
the layout: DP2 and PP2 (the MTP layer on the last stage) give the same MTP losses and MTP
gradients; training the same step again lowers it; full recompute leaves every gradient as it
is. The weight sync leaves the MTP layers out
(no engine drafts with them); the export holds every name the checkpoint has. ``vime train``
with slime's flags passes the gap check after each sync, logs ``mtp_loss``, and exports the
trained MTP layer (moved, its copies of the output layer equal to the trained one), which
transformers loads. A checkpoint without DeepSeek-V3-style MTP layers is refused at launch.
"""

import json

import numpy as np
import pytest

from tests.shell.mtp_workers import as_mimo, mtp_worker, reference_worker, with_deepseek_mtp
from tests.shell.train_cli import (assert_transformers_loads, train_and_export, vime,
                                   with_embedded_tokenizer)
from vime_shell.megatron.spawn import spawn
from vime_shell.models.auto_config import auto_config
from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    model = build_tiny_hf_model(tmp_path_factory.mktemp("mtp") / "glm47",
                                TinyModelSpec(arch="glm4_moe_lite", num_layers=3, vocab_size=20))
    return with_embedded_tokenizer(with_deepseek_mtp(model))


@pytest.fixture(scope="module")
def glm45_model(tmp_path_factory):
    model = build_tiny_hf_model(tmp_path_factory.mktemp("mtp") / "glm45",
                                TinyModelSpec(arch="glm4_moe", num_layers=3, vocab_size=20))
    return with_embedded_tokenizer(with_deepseek_mtp(model))


@pytest.fixture(scope="module")
def models(mtp_model, glm45_model, mimo_model):
    return {"glm47": mtp_model, "glm45": glm45_model, "mimo": mimo_model}


@pytest.fixture(scope="module")
def mimo_model(tmp_path_factory):
    model = build_tiny_hf_model(tmp_path_factory.mktemp("mtp") / "mimo",
                                TinyModelSpec(num_layers=3, vocab_size=20))
    return with_embedded_tokenizer(as_mimo(model))


@pytest.fixture(scope="module")
def runs(mtp_model):
    return spawn(mtp_worker, 2, str(mtp_model))


@pytest.mark.parametrize("family", ["glm47", "glm45", "mimo"])
def test_the_mtp_loss_is_the_checkpoints_module_in_transformers(family, models):
    (ref,) = spawn(reference_worker, 1, str(models[family]))
    assert ref["tokens"] > 100
    assert ref["reported"] == pytest.approx(ref["hf"], abs=1e-6)


def test_only_the_mtp_layers_learn_from_it(runs):
    for rank in runs:
        trained, plain = rank["dp2"]["grads"], rank["dp2_plain"]["grads"]
        mtp = {k for k in trained if k.startswith("mtp.")}
        assert mtp and set(trained) - mtp == set(plain)
        for name in plain:
            np.testing.assert_allclose(trained[name], plain[name], rtol=0, atol=1e-7,
                                       err_msg=name)
        assert all(np.abs(trained[k]).max() > 0 for k in mtp)
    assert runs[0]["dp2_plain"]["mtp_losses"] == [None] * 4


def test_dp2_and_pp2_train_the_mtp_layer_alike_and_it_learns(runs):
    dp2, last = runs[0]["dp2"], runs[1]["pp2"]
    assert dp2["mtp_built"] and last["mtp_built"] and not runs[0]["pp2"]["mtp_built"]
    np.testing.assert_allclose(last["mtp_losses"], dp2["mtp_losses"], rtol=0, atol=1e-6)
    for name, grad in last["grads"].items():
        if name.startswith("mtp."):
            np.testing.assert_allclose(grad, dp2["grads"][name], rtol=0, atol=1e-7)
    losses = dp2["mtp_losses"]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def test_full_recompute_leaves_the_gradients_as_they_are(runs):
    """slime's MTP scripts recompute every layer; the MTP layers run without it (mtp.py:
    megatron-core 0.16's MTP recompute gave other gradients, up to 1.7e-3)."""
    for rank in runs:
        plain, recomputed = rank["dp2"]["grads"], rank["dp2_recompute"]["grads"]
        assert set(plain) == set(recomputed)
        for name in plain:
            np.testing.assert_allclose(recomputed[name], plain[name], rtol=0, atol=1e-7,
                                       err_msg=name)


def test_the_sync_leaves_the_mtp_layer_out_and_the_export_keeps_it(runs, mtp_model):
    from safetensors.torch import load_file

    source = sorted(load_file(next(mtp_model.glob("*.safetensors"))))
    for run in (runs[0]["dp2"], runs[1]["pp2"], runs[0]["pp2"]):  # each name once
        assert run["export"] == source
        assert run["synced"] == [k for k in source if not k.startswith("model.layers.2.")]


MOVED = {"glm47": ("model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight",
                   "model.layers.2.self_attn.q_a_proj.weight"),
         "glm45": ("model.layers.2.eh_proj.weight", "model.layers.2.hnorm.weight",
                   "model.layers.2.self_attn.q_proj.weight"),
         "mimo": ("model.mtp_layers.0.input_proj.weight",
                  "model.mtp_layers.0.token_layernorm.weight",
                  "model.mtp_layers.0.self_attn.q_proj.weight")}


@pytest.mark.parametrize("family", ["glm47", "glm45", "mimo"])
def test_vime_train_trains_and_exports_the_mtp_layer(family, models, tmp_path):
    from safetensors.torch import load_file

    model = models[family]
    base = load_file(next(model.glob("*.safetensors")))
    trained = train_and_export(model, tmp_path, "--enable-mtp-training",
                               "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.2")
    assert set(trained) == set(base)
    for key in MOVED[family]:
        assert float((trained[key] - base[key]).abs().max()) > 0, key
    if family != "mimo":  # the MTP layer's copy of the output layer is the trained one
        assert (trained["model.layers.2.shared_head.head.weight"] ==
                trained["lm_head.weight"]).all()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert all(np.isfinite(json.loads(x)["mtp_loss"]) for x in lines)
    # MiMo's model_type is remote code: loaded as vime's engines load it (a Qwen2)
    config = auto_config(tmp_path / "hf") if family == "mimo" else None
    assert_transformers_loads(tmp_path / "hf", trained, ["lm_head.weight"], config)


def test_a_checkpoint_without_mtp_layers_vime_maps_is_refused(tmp_path):
    model = with_embedded_tokenizer(build_tiny_hf_model(tmp_path / "m", TinyModelSpec()))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    done = vime("train", "--hf-checkpoint", str(model), "--run-dir", str(tmp_path / "run"),
                "--dry-run", "--enable-mtp-training", "--mtp-num-layers", "1", home=tmp_path)
    assert done.returncode == 2
    assert "--enable-mtp-training=True: trains the MTP layers of" in done.stderr
    assert "the checkpoint is qwen2" in done.stderr
