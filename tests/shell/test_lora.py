"""LoRA (``--lora-rank``, miles' flags): adapters on Megatron's parallel linear layers
(``vime_shell.megatron.lora``), the base frozen, the merged weights to the engine and
``--save-hf``.

Asserted, on a 4-layer tiny Qwen2 trained for 4 Adam steps with adapters on every linear
layer, in one 2-process gloo spawn (DP2, TP2, PP2):

- a fresh adapter (B = 0) exports the base model bit for bit, and after training the base
  weights are unchanged bit for bit, as are the embedding and norms; every adapted HF weight
  (q/k/v/o, gate/up/down) has moved, and only the adapters train;
- the merged export, loaded into transformers, gives the trainer's logits (1e-5, fp32);
- TP2 and PP2 train to DP2's merged weights (1e-5: the adapters start layout-independent);
- a checkpoint taken after rollout 1 resumes (DP2, TP2) to the same final weights;
- ``vime train --lora-rank`` on the embedded model: the engine's log-probs after each sync of
  the merged weights match the trainer's, the ``--save-hf`` export loads in transformers,
  and only the targeted HF weights differ from the base;
- the flags follow miles' rules (adapters on MoE experts: ``test_lora_experts.py``).
"""


import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.shell.lora_workers import lora_worker
from tests.shell.train_cli import logprob_gaps, vime
from vime_shell.megatron.lora_options import LoraOptions, LoraOptionsError
from vime_shell.megatron.platform import Platform
from vime_shell.megatron.spawn import spawn
from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model
from vime_shell.settings.common import ConfigError
from vime_shell.settings.train_config import TrainConfig

ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    hf_dir = build_tiny_hf_model(root / "tiny", TinyModelSpec(num_layers=4))
    original = {k: v.numpy() for k, v in load_file(f"{hf_dir}/model.safetensors").items()}
    return original, spawn(lora_worker, 2, str(hf_dir), str(root / "ckpt"))


def _max(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max()) for k in b)


@pytest.mark.parametrize("name", ["dp2", "tp2", "pp2"])
def test_the_base_is_frozen_and_the_adapters_train(lora_runs, name):
    original, per_rank = lora_runs
    for run in (r[name] for r in per_rank):
        assert _max(run["fresh"], original) == 0.0  # B = 0: the base model, bit for bit
        assert _max(run["base"], original) == 0.0  # trained: the base never changed
        moved = {k for k in original if not np.array_equal(run["final"][k], original[k])}
        assert moved and all(k.split(".")[-2] in ADAPTED for k in moved)  # no norm, embedding
        assert {k.split(".")[-2] for k in moved} == set(ADAPTED)
        assert run["trainable"] == run["adapter"] > 0


@pytest.mark.parametrize("name", ["dp2", "tp2"])
def test_the_merged_export_gives_the_trainers_logits(lora_runs, name):
    for run in (r[name] for r in lora_runs[1]):
        assert run["logit_max"] < 1e-5


@pytest.mark.parametrize("name", ["tp2", "pp2"])
def test_layouts_train_to_the_same_weights(lora_runs, name):
    per_rank = lora_runs[1]
    assert _max(per_rank[0][name]["final"], per_rank[0]["dp2"]["final"]) < 1e-5
    for a, b in zip(per_rank[0][name]["metrics"], per_rank[0]["dp2"]["metrics"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)


@pytest.mark.parametrize("name", ["dp2", "tp2"])
def test_a_checkpoint_resumes_to_the_same_weights(lora_runs, name):
    for run in (r[name] for r in lora_runs[1]):
        assert _max(run["resume"]["final"], run["final"]) < 1e-6


def test_target_names_map_to_megatrons_fused_layers():
    assert LoraOptions(rank=8, target_modules=("q_proj", "v_proj")).megatron_modules == (
        "linear_qkv",)
    assert LoraOptions(rank=8, target_modules=("all-linear",)).megatron_modules == (
        "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    assert LoraOptions(rank=8, target_modules=("down_proj", "linear_proj")).megatron_modules \
        == ("linear_proj", "linear_fc2")
    # miles excludes HF names before mapping: a fused layer stays while any of its names does
    assert LoraOptions(rank=8, target_modules=("all-linear",), exclude_modules=(
        "q_proj",)).megatron_modules[0] == "linear_qkv"
    assert LoraOptions(rank=8, target_modules=("all-linear",), exclude_modules=(
        "gate_proj", "up_proj", "linear_fc2")).megatron_modules == ("linear_qkv", "linear_proj")
    assert LoraOptions(rank=8, alpha=32).scaling == 4.0
    with pytest.raises(LoraOptionsError, match="'foo': is not a linear layer vime adapts"):
        LoraOptions(rank=8, target_modules=("foo",)).megatron_modules
    with pytest.raises(LoraOptionsError, match="leaves no layer to adapt"):
        LoraOptions(rank=8, target_modules=("o_proj",), exclude_modules=("linear_proj",))


def test_flags_follow_miles_rules():
    assert TrainConfig().lora_options() is None  # --lora-rank 0: off, never an error
    assert TrainConfig(lora_rank=0, lora_alpha=16.0, lora_dropout=0.0).lora_options() is None
    cfg = TrainConfig(lora_rank=32, lora_alpha=32, target_modules="all-linear")
    assert cfg.lora_options() == LoraOptions(rank=32, alpha=32.0)
    with pytest.raises(ConfigError, match="--target-modules=None: is required with --lora"):
        TrainConfig(lora_rank=8)
    with pytest.raises(ConfigError, match="--lora-dropout=0.1: must be 0"):
        TrainConfig(lora_rank=8, target_modules="all-linear", lora_dropout=0.1)
    with pytest.raises(ConfigError, match="--lora-alpha=0.0: must be > 0"):
        TrainConfig(lora_rank=8, target_modules="all-linear", lora_alpha=0.0)
    with pytest.raises(ConfigError, match="lora_type='canonical_lora'"):
        TrainConfig(lora_type="canonical_lora")


def test_vime_train_syncs_and_exports_the_merged_weights(tmp_path):
    """Three rollouts with adapters on q/k/v only: the engine runs the merged weights (the
    log-prob gap after each sync is round-off), and --save-hf writes them."""
    done = vime("train", "--run-dir", str(tmp_path / "run"), "--num-rollout", "3",
                 "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
                 "--global-batch-size", "32", "--lr", "1e-2", "--lora-rank", "4",
                 "--lora-alpha", "8", "--target-modules", "q_proj,k_proj,v_proj",
                 "--custom-rm-path", "tests.shell.tied_workers:parity_reward",
                 "--save-hf", str(tmp_path / "hf"), home=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LoRA rank 4 (alpha 8) on linear_qkv:" in done.stderr
    gaps = logprob_gaps(tmp_path / "run")
    assert len(gaps) == 3 and max(gaps) < 1e-5
    base = load_file(next((tmp_path / "cache").rglob("model.safetensors")))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    trained = model.state_dict()
    moved = {k for k in base if not torch.equal(trained[k], base[k])}
    assert moved and {k.split(".")[-2] for k in moved} == {"q_proj", "k_proj", "v_proj"}


def test_a_lora_run_builds_the_local_spec_even_with_transformer_engine():
    """On a TE GPU the trainer would pack THD and fuse kernels around TE layers; LoRA wraps
    Megatron's own layers, so its model platform is the local spec's."""
    gpu = Platform(kind="cuda", backend="nccl", dtype=torch.bfloat16, transformer_engine=True,
                   packing="thd")
    local = gpu.local_spec()
    assert (local.transformer_engine, local.packing, local.supports_context_parallel) == (
        False, "mask", False)
    assert (local.kind, local.dtype) == ("cuda", torch.bfloat16)
