"""On-policy distillation (``--use-opd --opd-type megatron --opd-teacher-load DIR``, slime's):
each token's advantage minus ``--opd-kl-coef x (student log-prob - teacher log-prob)`` on top
of any estimator, the teacher a frozen model in the trainer.

Asserted: the shaping is slime's formula, per token, and acts on the advantages only (the
teacher gets no gradient); the flags follow slime's rules (a type and a teacher with
``--use-opd``, a teacher without it is an error, ``--opd-type sglang`` prints its table line,
a teacher of another architecture fails at launch naming both values); and a run whose reward
is constant (GRPO advantages 0) learns from the teacher alone: 8 rollouts on the embedded
model with a teacher of other weights bring the logged reverse KL down (its per-rollout
estimate is noisy: the mean of the last 3 against the first), and the --save-hf export is
written.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vime_pure.policy_config import LossConfig
from vime_pure.torch_ops.policy_loss import kl_shaped_advantages
from vime_shell.models.embedded import EmbeddedSpec, build_embedded
from vime_shell.settings.common import ConfigError
from vime_shell.settings.train_config import TrainConfig

SRC = str(Path(__file__).resolve().parents[1] / "src")


@given(st.lists(st.tuples(st.floats(-3, 3), st.floats(-6, -0.01), st.floats(-6, -0.01)),
                min_size=1, max_size=8), st.floats(0, 4))
def test_the_shaping_is_slimes_formula(tokens, coef):
    """``A - coef * (student - teacher)`` per token (slime's ``apply_opd_kl_to_advantages``),
    detached: the loss's gradient flows through the surrogate's log-probs only."""
    adv, student, teacher = (torch.tensor(c, dtype=torch.float64) for c in zip(*tokens))
    student = student.clone().requires_grad_(True)
    shaped = kl_shaped_advantages(adv, student, teacher, coef=coef, kind="k1")
    torch.testing.assert_close(shaped, adv - coef * (student.detach() - teacher))
    assert not shaped.requires_grad


def test_flags_follow_slimes_rules(tmp_path):
    teacher = str(tmp_path)
    cfg = TrainConfig(use_opd=True, opd_type="megatron", opd_teacher_load=teacher,
                      opd_kl_coef=0.5)
    assert cfg.loss_config() == LossConfig(opd_kl_coef=0.5)
    assert TrainConfig(opd_kl_coef=0.5).loss_config().opd_kl_coef == 0.0  # off without --use-opd
    with pytest.raises(ConfigError, match="--opd-type=None: is required with --use-opd"):
        TrainConfig(use_opd=True, opd_teacher_load=teacher)
    with pytest.raises(ConfigError, match="--opd-teacher-load=None: is required"):
        TrainConfig(use_opd=True, opd_type="megatron")
    with pytest.raises(ConfigError, match="is set but --use-opd is not"):
        TrainConfig(opd_teacher_load=teacher)
    done = subprocess.run([sys.executable, "-m", "vime_shell.cli", "train", "--use-opd",
                           "--opd-type", "sglang"], capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": SRC, "PATH": ""})
    assert done.returncode == 2 and "--opd-type sglang: not supported in vime (teacher " \
        "log-probs from an SGLang server" in done.stderr


def _train(tmp_path: Path, *extra: str, run: str = "run") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vime_shell.cli", "train", "--run-dir", str(tmp_path / run),
         "--num-rollout", "8", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
         "--global-batch-size", "32", "--lr", "1e-3",
         "--custom-rm-path", "tests.test_opd:no_reward", *extra],
        capture_output=True, text=True, timeout=600, cwd=str(Path(SRC).parent),
        env={"PYTHONPATH": f"{SRC}:{Path(SRC).parent}", "PATH": "", "OMP_NUM_THREADS": "1",
             "HOME": str(tmp_path), "VIME_CACHE_DIR": str(tmp_path / "cache")})


def no_reward(sample) -> float:
    """A constant reward: GRPO's advantages are 0, so only the teacher teaches."""
    return 0.0


@pytest.mark.slow
def test_the_teacher_alone_teaches(tmp_path):
    teacher = build_embedded(tmp_path / "teachers", EmbeddedSpec(seed=1))
    done = _train(tmp_path, "--use-opd", "--opd-type", "megatron", "--opd-teacher-load",
                  str(teacher), "--save-hf", str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split(
        "\n") if x]
    kl = [r["opd_reverse_kl"] for r in records]
    assert len(kl) == 8 and kl[0] > 0.05 and sum(kl[-3:]) / 3 < 0.5 * kl[0], kl
    assert (tmp_path / "hf" / "config.json").is_file()
    other = build_embedded(tmp_path / "wider", EmbeddedSpec(num_hidden_layers=3))
    done = _train(tmp_path, "--dry-run", "--use-opd", "--opd-type", "megatron",
                  "--opd-teacher-load", str(other), run="dry")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--opd-teacher-load=" in done.stderr
    assert "has --num-layers=3, the trained model 2" in done.stderr
