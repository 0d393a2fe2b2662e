"""gpt-oss (``vime_shell.megatron.gpt_oss_bridge``): attention sinks, a sliding window on
alternating layers, YaRN, biases on every projection and the router, the clamped SwiGLU
experts fused on disk.

Asserted on a tiny random gpt-oss (4 layers, the window 4 tokens on layers 0 and 2, 4 experts
top-2, sinks and biases drawn non-zero): the HF -> Megatron -> HF round trip is exact and the
logits equal transformers' (1e-6, fp32); the trainer's log-probs on packed rows (up to 7
samples, up to 14 tokens each, so the window cuts inside samples) equal transformers' one
sample at a time in both CPU attention layouts (1e-5); two rollouts train (4 Adam steps) and
move every tensor; the export ``--save-hf`` writes reloads in transformers with the trainer's
logits (1e-6); ``vime train`` with miles' gpt-oss flags (HF engine) passes the gap check after
each sync and exports the checkpoint's own names.
"""

import pytest
import torch
from safetensors.torch import load_file

from tests.shell.gpt_oss_workers import gpt_oss_worker
from tests.shell.train_cli import (assert_transformers_loads, train_and_export,
                                   with_embedded_tokenizer)
from vime_shell.megatron.spawn import spawn
from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gpt_oss_run(tmp_path_factory):
    model = build_tiny_hf_model(tmp_path_factory.mktemp("gpt_oss") / "m",
                                TinyModelSpec(arch="gpt_oss", num_layers=4))
    return spawn(gpt_oss_worker, 1, str(model))[0]


def test_the_round_trip_is_exact_and_logits_match_transformers(gpt_oss_run):
    run = gpt_oss_run["conversion"]
    assert run["roundtrip_keys_equal"] and run["roundtrip_max"] == 0.0
    assert run["logit_max"] <= 1e-6


def test_packed_rows_keep_the_window_and_sinks_inside_each_sample(gpt_oss_run):
    packed = gpt_oss_run["train"]["packed"]
    assert packed["samples_per_row"] > 1 and packed["longest_sample"] > 4  # the window cuts
    assert packed["mask"] <= 1e-5 and packed["padded"] <= 1e-5
    assert gpt_oss_run["train"]["hf_logprob_max"] <= 1e-5


def test_training_moves_every_tensor_and_transformers_reloads_the_export(gpt_oss_run):
    run = gpt_oss_run["train"]
    assert len(run["losses"]) == 4 and run["losses_finite"]
    assert run["moved"] == run["keys"]  # sinks, router and expert biases included
    assert run["trained_logit_moved"] > 1e-3  # the reload below compares trained weights
    assert run["reloaded_class"] == "GptOssForCausalLM"
    assert run["reload_tensor_max"] == 0.0 and run["reload_logit_max"] <= 1e-6


def test_vime_train_with_miles_flags_syncs_and_exports_a_gpt_oss(tmp_path):
    model = with_embedded_tokenizer(build_tiny_hf_model(
        tmp_path / "m", TinyModelSpec(arch="gpt_oss", vocab_size=20)))
    trained = train_and_export(model, tmp_path, "--softmax-type", "learnable",
                               "--window-size", "3,0", "--window-attn-skip-freq", "2")
    base = load_file(model / "model.safetensors")
    assert set(trained) == set(base)  # the fused expert names, as on disk
    moved = [k for k in base if not torch.equal(trained[k], base[k])]
    assert any("sinks" in k for k in moved) and any("gate_up_proj" in k for k in moved)
    assert assert_transformers_loads(tmp_path / "hf", trained, moved) == "GptOssForCausalLM"
