"""``vime train`` as a user runs it, for the model-family tests (``test_lora``, ``test_mla``,
``test_glm4``, ``test_glm4_moe``): a subprocess of its own in a scratch home and cache, a tiny
model given the embedded model's tokenizer (the task's digits and a chat template), the log-prob
gaps the loop checked after each weight sync, and the three-rollout run with an export that the
family tests share (:func:`train_and_export`).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

from vime_shell.models.embedded import build_embedded

SRC = str(Path(__file__).resolve().parents[2] / "src")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def vime(*argv: str, home: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m vime_shell.cli *argv`` with ``home`` as its HOME and ``home/cache`` as its
    ``VIME_CACHE_DIR``; the tests' modules (reward functions) importable."""
    return subprocess.run([sys.executable, "-m", "vime_shell.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=str(Path(SRC).parent),
                          env={"PYTHONPATH": f"{SRC}:{Path(SRC).parent}", "PATH": "",
                               "OMP_NUM_THREADS": "1", "HOME": str(home),
                               "VIME_CACHE_DIR": str(home / "cache")})


def with_embedded_tokenizer(model: Path) -> Path:
    """``model`` with the embedded model's tokenizer files copied in."""
    for name in TOKENIZER_FILES:
        shutil.copy(build_embedded() / name, model / name)
    return model


def logprob_gaps(run_dir: Path) -> list[float]:
    """The engine-trainer log-prob gap of every rollout in ``run_dir/metrics.jsonl`` that has
    one (the loop's check after each weight sync)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [r["logprob_gap"] for r in rows if r.get("logprob_gap") is not None]


def train_and_export(model: Path, tmp_path: Path, *extra: str) -> dict:
    """3 rollouts of the parity task on ``model`` (the HF engine following each sync), exported
    with ``--save-hf`` to ``tmp_path/hf`` (``extra``: more flags); asserts the run passed the
    gap check every rollout and returns the exported tensors by their HF names (as the files
    hold them: transformers 5 fuses experts in its state dict)."""
    done = vime("train", "--hf-checkpoint", str(model), "--run-dir", str(tmp_path / "run"),
                "--num-rollout", "3", "--rollout-batch-size", "8", "--n-samples-per-prompt",
                "4", "--global-batch-size", "32", "--lr", "1e-3", "--custom-rm-path",
                "tests.shell.tied_workers:parity_reward", "--save-hf", str(tmp_path / "hf"),
                *extra, home=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    gaps = logprob_gaps(tmp_path / "run")
    assert len(gaps) == 3 and max(gaps) < 1e-4
    return {k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(f).items()}


def assert_transformers_loads(hf_dir: Path, trained: dict, names, config=None) -> str:
    """``hf_dir`` (an export) loads in transformers (with ``config``, where its model_type is
    remote code: ``auto_config``'s alias) with each of ``names`` equal to ``trained``'s
    tensor, found under transformers' own name (its multimodal prefix dropped, its experts
    fused: ``vime_shell.models.hf_names``); returns the loaded class's name."""
    import torch
    from transformers import AutoModelForCausalLM

    from vime_shell.models.hf_names import fused_expert_slice, in_memory_name

    native = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, **({} if config is None else {"config": config}))
    state = native.state_dict()
    for name in names:
        target = state.get(in_memory_name(name))
        if target is None:  # transformers holds the experts fused
            target = fused_expert_slice(state, in_memory_name(name))
        assert target is not None and torch.equal(target, trained[name]), name
    return type(native).__name__
