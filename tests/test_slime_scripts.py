"""Our corpus of slime-style launch scripts (bash arrays, ``${MODEL_ARGS[@]}``, ``ray job
submit -- python3 train.py ...``) runs unchanged through ``vime train --dry-run``: stand-ins for
``ray`` and ``python3`` on PATH turn the job into the dry run. Each script exits 0, passes every
launch check, and its notes say where vime differs."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.qwen_tokenizer import with_qwen35_tokenizer
from tests.shell.mtp_workers import as_mimo, with_deepseek_mtp
from tests.shell.train_cli import with_embedded_tokenizer
from vime_shell.engines import vllm_available
from vime_shell.models.embedded import build_embedded
from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model
from vime_shell.rollout.tasks import arithmetic_rows, write_jsonl

SCRIPTS = Path(__file__).parent / "slime_scripts"
REPO = Path(__file__).resolve().parents[1]

FAKE_RAY = """#!/bin/bash
# `ray start/stop`: nothing; `ray job submit [opts] -- CMD...`: run CMD here
if [ "$1" = job ]; then while [ "$1" != "--" ]; do shift; done; shift; exec "$@"; fi
exit 0
"""
FAKE_PYTHON = """#!/bin/bash
if [ "$1" = train.py ]; then shift; exec "$VIME_PYTHON" -m vime_shell.cli train --dry-run "$@"; fi
if [ "$1" = train_async.py ]; then  # slime's one-step-off trainer: vime's --train-async
  shift; exec "$VIME_PYTHON" -m vime_shell.cli train --dry-run --train-async "$@"
fi
exec "$VIME_PYTHON" "$@"
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("slime")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for name, text in (("ray", FAKE_RAY), ("python3", FAKE_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    train, held_out = arithmetic_rows(seed=0)
    data = root / "data"
    write_jsonl(data / "train.jsonl", train)
    write_jsonl(data / "eval.jsonl", held_out)
    write_jsonl(data / "conversations.jsonl", [  # the SFT script's set
        {"messages": [{"role": "user", "content": f"{a}{b}>"},
                      {"role": "assistant", "content": f"{b}{a}"}]}
        for a in range(4) for b in range(4)])
    embedded = build_embedded()
    moe = build_tiny_hf_model(root / "moe", TinyModelSpec(arch="qwen3_moe"))
    # Moonlight: DeepSeek-V3's architecture without a query low-rank projection
    moonlight = build_tiny_hf_model(root / "moonlight", TinyModelSpec(arch="deepseek_v3",
                                                                      q_lora_rank=None))
    glm4 = build_tiny_hf_model(root / "glm4", TinyModelSpec(arch="glm4"))
    glm47 = build_tiny_hf_model(root / "glm47", TinyModelSpec(arch="glm4_moe_lite"))
    glm45 = build_tiny_hf_model(root / "glm45", TinyModelSpec(arch="glm4_moe", vocab_size=20))
    qwen35 = build_tiny_hf_model(root / "qwen35", TinyModelSpec(arch="qwen3_5", num_layers=4,
                                                                vocab_size=20))
    minimax = build_tiny_hf_model(root / "minimax", TinyModelSpec(arch="minimax_m2",
                                                                  vocab_size=20))
    write_jsonl(data / "qwen35_conversations.jsonl", [  # reasoning the template drops later
        {"messages": [{"role": "user", "content": f"{a}+{b}?"},
                      {"role": "assistant", "content": f"<think>\nadd</think>\n{a + b}"},
                      {"role": "user", "content": "again"},
                      {"role": "assistant", "content": f"<think>\nsame</think>\n{a + b}"}]}
        for a in range(4) for b in range(4)])
    qwen35_moe = with_qwen35_tokenizer(build_tiny_hf_model(root / "qwen35_moe", TinyModelSpec(
        arch="qwen3_5_moe", num_layers=4)))
    qwen3_next = build_tiny_hf_model(root / "qwen3_next", TinyModelSpec(
        arch="qwen3_next", num_layers=4, vocab_size=20))
    # one multi-token prediction layer each (--enable-mtp-training): DeepSeek-V3's names, MiMo's
    glm47_mtp = with_deepseek_mtp(build_tiny_hf_model(root / "glm47_mtp", TinyModelSpec(
        arch="glm4_moe_lite", num_layers=3)))
    mimo = as_mimo(build_tiny_hf_model(root / "mimo", TinyModelSpec(num_layers=3)))
    glm5 = build_tiny_hf_model(root / "glm5", TinyModelSpec(arch="glm_moe_dsa", num_layers=4))
    for model in (moe, moonlight, glm4, glm47, glm45, qwen35, minimax, qwen3_next, glm47_mtp,
                  mimo, glm5):
        with_embedded_tokenizer(model)  # the dataset's digits and a chat template
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "VIME_PYTHON": sys.executable, "MODEL_DIR": str(embedded), "MOE_DIR": str(moe),
            "MOONLIGHT_DIR": str(moonlight), "GLM4_DIR": str(glm4), "GLM47_DIR": str(glm47),
            "GLM45_DIR": str(glm45), "QWEN35_DIR": str(qwen35),
            "MINIMAX_DIR": str(minimax), "QWEN3_NEXT_DIR": str(qwen3_next),
            "QWEN35_MOE_DIR": str(qwen35_moe), "GLM47_MTP_DIR": str(glm47_mtp),
            "MIMO_DIR": str(mimo), "GLM5_DIR": str(glm5),
            "DATA_DIR": str(data), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(SCRIPTS)])}


def _run(script: str, env: dict, run_dir: Path, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPTS / script)],
                          env={**env, "RUN_DIR": str(run_dir), **extra},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script, notes", [
    ("run-tiny-grpo.sh", ["--load", "starting fresh", "--sequence-parallel",
                          "--attention-backend"]),
    ("run-tiny-dapo.sh", ["--eval-prompt-data without --eval-interval: evaluating after the "
                          "last", "--sglang-ep-size 1: no vLLM equivalent in vime; ignored"]),
    ("run-tiny-remote-rm.sh", [] if vllm_available() else ["the HF engine takes no vLLM"]),
    ("run-tiny-moe.sh", ["--moe-token-drop-policy: accepted; vime's MoE is dropless",
                         "--update-weight-transfer-mode: accepted; vime syncs in-process",
                         "--sequence-parallel: off at --tensor-model-parallel-size 1"]),
])
def test_slime_style_script_passes_the_dry_run(script, notes, env, tmp_path):
    out = _run(script, env, tmp_path / "run")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "every launch check passed" in out.stdout
    assert "schedule of one synthetic rollout" in out.stdout
    for note in notes:
        assert note in out.stderr, (note, out.stderr[-2000:])
    assert not (tmp_path / "run" / "ckpt").exists()  # a dry run writes no checkpoint


# slime's own scripts, ported (tests/slime_scripts/run-qwen3-*.sh, run-retool-*.sh): each
# failed its dry run for a reason of vime's alone before issue 31. They launch 2 ranks.
TWO_RANKS = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "NUM_GPUS": "2"}
WANDB_KEY = "slime-script-test-key-7c1e"


@pytest.mark.parametrize("script, notes", [
    ("run-qwen3-4B.sh", [
        "--use-precision-aware-optimizer: turns on the distributed optimizer",
        "--use-precision-aware-optimizer: no TransformerEngine here",
        "--wandb-always-use-train-step: accepted"]),
    ("run-qwen3-30B-A3B.sh", [
        "one path is slime's legacy form, an eval set named aime",
        "--use-precision-aware-optimizer: turns on the distributed optimizer",
        "--sglang-cuda-graph-bs 1 2 4 8 16"]),
    ("run-retool-qwen3-4B.sh", []),
    ("run-qwen3-4B-base-sft.sh", [
        "slime's SFT rollout function; vime's counterpart is vime_shell.rollout.sft:sft_rollout"]),
    ("run-qwen3-4B-megatron-lora.sh", [  # miles' (examples/lora)
        "--sequence-parallel: off with LoRA"]),
    ("run-glm4-9B.sh", [  # slime's GLM-4 layer spec
        "--sequence-parallel: off on the local layer spec"]),
    ("run-qwen3-4B-mis.sh", [  # slime's MIS: --custom-config-path over the flags
        "--tis-function examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp: "
        "vime's built-in mis TIS weights"]),
    ("run-qwen3-4B-fsdp-mis.sh", [  # miles' MIS on its FSDP backend: Megatron DP here
        "--train-backend fsdp: turns on the distributed optimizer",
        "--gradient-checkpointing: --recompute-granularity full",
        "--attn-implementation: accepted",
        "the --hf-checkpoint directory, HF weights without a checkpoint: starting from them"]),
    ("run-glm4.7-30B-A3B-delta.sh", [  # GLM-4.7-Flash: DeepSeek-V3's model, GLM's config
        "--update-weight-mode: accepted; vime syncs full weights in-process"]),
    ("run-glm4.7-355B-A32B.sh", [  # GLM-4.5's MoE architecture (glm4_moe)
        "--sglang-speculative-algorithm EAGLE: no vLLM equivalent in vime; ignored"]),
    ("run-qwen3.5-27B.sh", [  # linear and gated attention (slime's qwen3_5 layer spec)
        "--sequence-parallel: off on the local layer spec",
        "--sglang-speculative-algorithm EAGLE: no vLLM equivalent in vime; ignored"]),
    ("run-qwen3.5-35B-A3B-sft.sh", [  # --loss-mask-type qwen3_5 on its chat template
        "slime's SFT rollout function",
        "--train-async: the SFT rollout generates nothing"]),
    ("run-qwen3-next-80B-A3B.sh", [  # slime's qwen3_next layer spec, MoE
        "--sglang-speculative-algorithm EAGLE: no vLLM equivalent in vime; ignored"]),
    ("run-minimax-m2.sh", [  # q/k norms over all heads (slime's minimax_m2 layer spec)
        "--sglang-ep-size 16: no vLLM equivalent in vime; ignored",
        "slime's filter of prompt groups whose rewards are all equal"]),
    ("run-qwen3-8B-opd.sh", [  # miles' top-k on-policy distillation from a teacher server
        "miles.rollout.on_policy_distillation.reward_func"]),
    ("run-glm4.7-30B-A3B.sh", [  # --enable-mtp-training: GLM-4.7-Flash's MTP layer, PP2
        "--sglang-speculative-algorithm EAGLE: no vLLM equivalent in vime; ignored"]),
    ("run-mimo-7B-rl-eagle.sh", [  # --enable-mtp-training: MiMo's MTP layer names
        "--sglang-speculative-algorithm EAGLE: no vLLM equivalent in vime; ignored"]),
    ("run-glm5-744B-A40B.sh", [  # DeepSeek sparse attention (slime's glm5 layer spec)
        "--prefill-num-servers 1: slime's prefill-decode disaggregation",
        "--sglang-attention-backend nsa"]),
    ("run-moonlight-16B-A3B.sh", [  # multi-latent attention
        "--moe-router-bias-update-rate: accepted; vime keeps a DeepSeek-V3 router's expert bias",
        "--sglang-cuda-graph-bs 1 2 4 8 16"]),
])
def test_slimes_own_scripts_pass_the_dry_run(script, notes, env, tmp_path):
    """The issue's three: --expert-tensor-parallel-size 1 on a dense model at TP 2, the
    precision-aware optimizer without --use-distributed-optimizer, slime's W&B flags (the key
    in no line vime prints), one eval path; retool's plugins by stand-ins of its signatures."""
    out = _run(script, env, tmp_path / "run", WANDB_KEY=WANDB_KEY, **TWO_RANKS)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "every launch check passed" in out.stdout
    assert "parallel layout: world 2" in out.stdout
    for note in notes:
        assert note in out.stderr, (note, out.stderr[-3000:])
    vime_lines = [line for line in out.stderr.splitlines() if line.startswith("vime")]
    assert WANDB_KEY not in out.stdout and not any(WANDB_KEY in x for x in vime_lines)
    # (bash's `set -x` of slime's script echoes its own command line, key and all)


def test_miles_muon_script_passes_the_dry_run(env, tmp_path):
    """miles' eval example with MILES_OPTIMIZER=muon (--optimizer muon --muon-momentum 0.9)
    at TP 2: accepted, and the configuration it prints says Muon."""
    out = _run("run-qwen3-4B-eval-muon.sh", env, tmp_path / "run", WANDB_KEY=WANDB_KEY,
               MILES_OPTIMIZER="muon", **TWO_RANKS)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "every launch check passed" in out.stdout
    assert "* --optimizer muon" in out.stdout and "  --muon-momentum 0.9" in out.stdout


def test_a_script_for_another_checkpoint_fails_naming_both_values(env, tmp_path):
    out = _run("run-tiny-grpo.sh", {**env, "MODEL_ARGS_ROTARY_BASE": "1000000"}, tmp_path)
    assert out.returncode == 2
    line = out.stderr.strip().splitlines()[-1]
    assert "--rotary-base=1000000.0" in line and '"rope_theta": 10000.0' in line, line


def test_a_moe_script_for_another_layer_pattern_fails_naming_both(env, tmp_path):
    """slime's qwen3 MoE model file with one dense first layer, against an all-MoE config."""
    script = (SCRIPTS / "models" / "tiny-qwen3-moe.sh").read_text()
    models = tmp_path / "s" / "models"
    models.mkdir(parents=True)
    (models / "tiny-qwen3-moe.sh").write_text(script.replace("FIRST_K_DENSE_REPLACE=0",
                                                             "FIRST_K_DENSE_REPLACE=1"))
    (tmp_path / "s" / "run.sh").write_text((SCRIPTS / "run-tiny-moe.sh").read_text())
    out = subprocess.run(["bash", str(tmp_path / "s" / "run.sh")],
                         env={**env, "RUN_DIR": str(tmp_path / "run")}, capture_output=True,
                         text=True, timeout=120)
    line = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and "--moe-layer-freq='[0,1]'" in line and "[1, 1]" in line, line


def test_engine_flags_of_a_script_reach_the_vllm_arguments(env, tmp_path):
    out = _run("run-tiny-remote-rm.sh", env, tmp_path)
    assert "--vllm-engine-args max_num_seqs=64 max_num_batched_tokens=4096" in out.stdout, \
        out.stderr[-2000:]
