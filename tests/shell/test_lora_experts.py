"""LoRA on MoE experts (miles' ``gate_proj,up_proj,down_proj`` targets on a MoE model, and
``--experts-shared-outer-loras``), the flags that go with miles' MoE LoRA scripts, and their
launch rules.

Asserted, on a 2-layer tiny Qwen3-MoE (4 experts, top-2) trained for 4 Adam steps with adapters
on every linear layer, in one 2-process gloo spawn (DP2 and EP2, each in miles' per-expert and
shared-outer layouts):

- a fresh adapter (B = 0) exports the base model bit for bit; after training the base weights
  are unchanged bit for bit; the router, norms and embeddings never move; every expert's
  gate/up/down and the attention weights move; only the adapters train;
- the shared-outer layout shares exactly linear_fc1's A and linear_fc2's B across a layer's
  experts (the per-expert layout none), and the shared factors stay identical on both EP ranks;
- every merged expert weight in the export equals ``W + alpha/rank x B A`` re-derived in
  float64 from that expert's factors (1e-6);
- the export written as ``--save-hf`` writes it reloads in transformers with the trainer's
  logits (1e-5, fp32);
- EP2 trains to EP1's weights (1e-5) and losses (1e-6), in both layouts;
- a checkpoint taken at EP2 (shared-outer) resumes to the same weights (1e-6);
- ``vime train`` with the MoE LoRA flags syncs the merged weights to the engine (gap after each
  sync < 1e-5) and exports them;
- the flags' rules: ``--experts-shared-outer-loras`` needs ``--lora-rank``; experts under TP 2
  are refused at launch; ``--lora-base-cpu-backup`` is a documented no-op.
"""

import attrs
import numpy as np
import pytest
from safetensors.torch import load_file

from tests.shell.lora_experts_workers import EXPERT_LAYOUTS, LAYOUTS, RESUMED, \
    lora_experts_worker
from tests.shell.moe_loop_workers import build_moe_chat_model
from tests.shell.train_cli import logprob_gaps, vime
from vime_shell.megatron.layout import resolve_layout
from vime_shell.megatron.lora_options import LoraOptions
from vime_shell.megatron.spawn import spawn
from vime_shell.models.hf_config import HfConfigSummary
from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model
from vime_shell.run.model_checks import check_model_settings
from vime_shell.settings.common import ConfigError
from vime_shell.settings.flags import parse_train_config
from vime_shell.settings.train_config import TrainConfig

MOE = HfConfigSummary(model_type="qwen3_moe", num_layers=2, vocab_size=128,
                      max_position_embeddings=512, num_experts=4)
RUNS = [(e, n) for e in EXPERT_LAYOUTS for n in LAYOUTS]
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def expert_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_experts")
    hf_dir = build_tiny_hf_model(root / "tiny", TinyModelSpec(arch="qwen3_moe", num_layers=2))
    original = {k: v.numpy() for k, v in load_file(f"{hf_dir}/model.safetensors").items()}
    return original, spawn(lora_experts_worker, 2, str(hf_dir), str(root))


def _max(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max()) for k in b)


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=["-".join(r) for r in RUNS])
def test_only_the_adapters_train(expert_runs, run):
    original, per_rank = expert_runs
    for out in (r[run] for r in per_rank):
        assert _max(out["fresh"], original) == 0.0  # B = 0: the base model, bit for bit
        assert _max(out["base"], original) == 0.0  # trained: the base never changed
        moved = {k for k in original if not np.array_equal(out["final"][k], original[k])}
        assert {k.split(".")[-2] for k in moved} == set(ADAPTED)  # no router, norm, embedding
        experts = {k.split(".experts.")[1].split(".")[0] for k in moved if ".experts." in k}
        assert experts == {"0", "1", "2", "3"}
        assert out["trainable"] == out["adapter"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=["-".join(r) for r in RUNS])
def test_shared_outer_factors_are_one_per_layer(expert_runs, run):
    shared = run[0] == "shared_outer"
    for out in (r[run] for r in expert_runs[1]):
        assert out["sharing"] == {"fc1_A": shared, "fc1_B": False, "fc2_A": False,
                                  "fc2_B": shared}
    ranks = [r[run]["factors"] for r in expert_runs[1]]
    outer = [n for n in ranks[0] if "lora_shared_experts" in n]
    assert len(outer) == (4 if shared else 0)  # fc1 A and fc2 B of each of the 2 layers
    for name in outer:  # replicated, and kept so by DDP's reduction under EP too
        assert np.array_equal(ranks[0][name], ranks[1][name])


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=["-".join(r) for r in RUNS])
def test_merged_experts_are_base_plus_scaled_b_a(expert_runs, run):
    for out in (r[run] for r in expert_runs[1]):
        assert out["merged_gap"] < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=["-".join(r) for r in RUNS])
def test_the_export_reloads_in_transformers_with_the_trainers_logits(expert_runs, run):
    for out in (r[run] for r in expert_runs[1]):
        assert out["logit_max"] < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(EXPERT_LAYOUTS))
def test_ep2_trains_like_ep1(expert_runs, layout):
    ep1, ep2 = expert_runs[1][0][(layout, "dp2")], expert_runs[1][0][(layout, "ep2")]
    assert _max(ep2["final"], ep1["final"]) < 1e-5
    assert len(ep1["metrics"]) == len(ep2["metrics"]) == 4
    for a, b in zip(ep2["metrics"], ep1["metrics"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)


@pytest.mark.slow
def test_a_checkpoint_resumes_at_ep2(expert_runs):
    for out in (r[RESUMED] for r in expert_runs[1]):
        assert _max(out["resumed"], out["final"]) < 1e-6


@pytest.mark.slow
def test_vime_train_syncs_and_exports_merged_experts(tmp_path):
    """Two rollouts on a tiny Qwen3-MoE with miles' MoE LoRA flags: the engine runs the merged
    weights (gap after each sync is round-off) and --save-hf writes experts that moved."""
    moe = build_moe_chat_model(tmp_path / "moe")  # the embedded task's tokenizer
    done = vime("train", "--hf-checkpoint", str(moe), "--run-dir", str(tmp_path / "run"),
                "--num-rollout", "2", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
                "--global-batch-size", "32", "--lr", "1e-2", "--lora-rank", "4",
                "--lora-alpha", "8", "--target-modules", "gate_proj,up_proj,down_proj",
                "--experts-shared-outer-loras", "--lora-base-cpu-backup",
                "--custom-rm-path", "tests.shell.tied_workers:parity_reward",
                "--save-hf", str(tmp_path / "hf"), home=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "on linear_fc1,linear_fc2 (MoE experts: shared-outer)" in done.stderr
    gaps = logprob_gaps(tmp_path / "run")
    assert len(gaps) == 2 and max(gaps) < 1e-5
    base = load_file(moe / "model.safetensors")
    trained = {k: v for f in (tmp_path / "hf").glob("*.safetensors")
               for k, v in load_file(f).items()}
    moved = {k for k in base if not np.array_equal(trained[k].numpy(), base[k].numpy())}
    assert moved and {k.split(".")[-2] for k in moved} <= {"gate_proj", "up_proj", "down_proj"}


def test_expert_targets_and_layout_names():
    opts = LoraOptions(rank=8, target_modules=("gate_proj", "up_proj", "down_proj"),
                       experts_shared_outer=True)
    assert opts.expert_modules == ("linear_fc1", "linear_fc2")
    assert opts.expert_layout == "shared-outer"
    assert LoraOptions(rank=8, target_modules=("q_proj",)).expert_modules == ()
    assert LoraOptions(rank=8, target_modules=("down_proj",)).expert_layout == "per-expert"


def test_moe_lora_flags_parse_to_their_settings():
    cfg = parse_train_config(["--lora-rank", "8", "--target-modules",
                              "gate_proj,up_proj,down_proj", "--experts-shared-outer-loras",
                              "--lora-base-cpu-backup"])
    assert cfg.lora_options() == LoraOptions(
        rank=8, target_modules=("gate_proj", "up_proj", "down_proj"), experts_shared_outer=True)
    # --lora-base-cpu-backup changes nothing vime builds: the same adapters, the same sync
    assert cfg.lora_options() == TrainConfig(
        lora_rank=8, target_modules="gate_proj,up_proj,down_proj",
        experts_shared_outer_loras=True).lora_options()
    with pytest.raises(ConfigError, match="--experts-shared-outer-loras=True: lays out LoRA "
                                          "adapters on MoE experts, and --lora-rank is 0"):
        TrainConfig(experts_shared_outer_loras=True)


def test_adapters_on_experts_under_tp2_are_refused_at_launch():
    layout = resolve_layout(world_size=2, num_layers=2, supports_context_parallel=False, tp=2,
                            num_experts=4)
    experts = parse_train_config(["--lora-rank", "8", "--target-modules", "all-linear"])
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size=2: splits qwen3_moe's "
                                          "experts .* Fix: use --tensor-model-parallel-size 1"):
        check_model_settings(attrs.evolve(experts, tensor_model_parallel_size=2), MOE, layout)
    attention = parse_train_config(["--lora-rank", "8", "--target-modules", "q_proj,v_proj",
                                    "--tensor-model-parallel-size", "2"])
    check_model_settings(attention, MOE, layout)  # no expert adapters: TP2 is fine
    check_model_settings(experts, MOE, resolve_layout(  # EP2 at TP 1: supported
        world_size=2, num_layers=2, supports_context_parallel=False, ep=2, num_experts=4))
