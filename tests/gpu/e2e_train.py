"""End to end on one GPU: ``vime train`` for a few rollouts, one JSON of what it measured.

``python -m tests.gpu.e2e_train --out runs/gpu-suite/e2e.json`` runs the loop exactly as
``vime train`` does (launch checks, then ``run_training``) on the embedded 334k-parameter Qwen2
built locally (no downloads), rewarded for the right first character (partial credit, so the
weights move from the first rollout): the Megatron trainer in the platform's dtype (bf16 on
CUDA), the vLLM engine when ``vllm`` imports and CUDA is present, else the HF engine. The gap
tolerance is the trainer dtype's (``vime_shell.engines.layout.logprob_gap_tolerance``): a sync
that fails stops the run with ``WeightSyncError``, loudly.

The JSON: per rollout the mean reward, the engine-trainer log-prob gap (rollout 0: same
checkpoint; rollout k: after sync k-1), generation tokens/s (response tokens / rollout time),
training tokens/s (trained tokens / log-prob + train time) and sync seconds; the peak memory
(PyTorch's allocator, the device's used memory sampled every 20 ms, which includes vLLM's
pool, and the host's max RSS); the engine, its dtype, and the engine flags passed
(``engine_flags``).

``--control-stale-sync`` is the measurement that sets a dtype's gap tolerance: the engine's
weight update is replaced by a drain (the engine keeps its old weights, as after a failed sync)
and the tolerance is lifted, so rollout k >= 1 logs the gap a *missed* sync produces. The
tolerance must sit between the normal run's gaps (noise) and these (signal).

Also run on CPU by ``tests/shell/test_gpu_workers_smoke.py`` (HF engine, fp32, 2 rollouts).
"""

import argparse
import json
import resource
import sys
import threading
import time
from pathlib import Path

import attrs
import numpy as np
import torch

from vime_shell.engines import vllm_available
from vime_shell.engines.layout import default_rollout_dtype, logprob_gap_tolerance
from vime_shell.run.launch_checks import launch_checks, model_dir
from vime_shell.settings.train_config import TrainConfig

TIME_LIMIT_S = 8 * 60  # the suite's budget on one H200-class GPU


class PeakDeviceMemory:
    """Samples ``total - free`` device memory in a thread (counts vLLM's own pool too)."""

    def __init__(self, period_s: float = 0.02):
        self.peak, self.period = 0, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            self._stop.wait(self.period)

    def __enter__(self) -> "PeakDeviceMemory":
        if torch.cuda.is_available():
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def first_char_reward(sample) -> float:
    """Partial credit (right first character), so an untrained model earns some reward in
    every rollout (~1/19 per sample), advantages are non-zero and the weights move: a sync then
    has something to carry, and a missed one shows."""
    meta = sample.metadata
    return float(meta["response"][:1] == meta["label"][:1])


def _engine_dtype(engine) -> str | None:
    if engine is None:
        return None
    llm = getattr(engine, "_llm", None)
    if llm is not None:
        return str(llm.llm_engine.model_config.dtype)
    return str(next(engine.model.parameters()).dtype)


def e2e_config(run_dir: str, *, cuda: bool, num_rollout: int, rollout_batch_size: int = 16,
               n_samples_per_prompt: int = 8) -> TrainConfig:
    """The run's settings: ``vime train``'s engine flags set explicitly (what a GPU user
    passes), the gap tolerance left to the rollout dtype's default."""
    groups = rollout_batch_size * n_samples_per_prompt
    return TrainConfig.from_mapping(dict(
        num_rollout=num_rollout, rollout_batch_size=rollout_batch_size,
        n_samples_per_prompt=n_samples_per_prompt, global_batch_size=groups,
        max_tokens_per_gpu=96, lr=1e-3, seed=0, run_dir=run_dir,
        rollout_engine="vllm" if cuda and vllm_available() else "hf",
        rollout_dtype=default_rollout_dtype(cuda), colocate=cuda, rollout_enforce_eager=True,
        custom_rm_path="tests.gpu.e2e_train:first_char_reward"))


def _stale_syncs() -> None:
    """Control run: every engine drains the sync's tensors and keeps its weights."""
    from vime_shell.engines.hf import HfEngine

    def drain(self, named_tensors) -> None:
        for _ in named_tensors:
            pass

    HfEngine.update_weights_from_tensors = drain
    if vllm_available():
        from vime_shell.engines.vllm import VllmEngine

        VllmEngine.update_weights_from_tensors = drain


def run_e2e(out_path: str | Path, *, num_rollout: int = 8, control_stale_sync: bool = False,
            **sizes: int) -> dict:
    """Run the training and write the JSON (module docstring); returns it."""
    cuda = torch.cuda.is_available()
    out_path = Path(out_path)
    cfg = e2e_config(str(out_path.parent / out_path.stem), cuda=cuda, num_rollout=num_rollout,
                     **sizes)
    if control_stale_sync:
        _stale_syncs()
        cfg = attrs.evolve(cfg, logprob_gap_tolerance=1e9)  # measure, never stop
    start = time.perf_counter()
    plan = launch_checks(cfg, model_dir(cfg))
    from vime_shell.run.driver import run_training  # torch + Megatron, as the CLI does

    rows: list[dict] = []
    engine_dtype: list[str | None] = []

    def on_rollout(event) -> None:
        m = event.metrics
        response_tokens = int(np.asarray(event.gather_batch().response_lengths).sum())
        rows.append({"rollout": event.rollout_id, "reward_mean": m["reward_mean"],
                     "logprob_gap": m["logprob_gap"], "logprob_gap_max": m["logprob_gap_max"],
                     "generation_tokens_per_s": response_tokens / max(m["rollout_s"], 1e-9),
                     "train_tokens_per_s": m["tokens"] / max(m["train_s"], 1e-9),
                     "sync_s": m["sync_s"]})
        if not engine_dtype:
            engine_dtype.append(_engine_dtype(event.engine))

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with PeakDeviceMemory() as device_peak:
        run_training(cfg, plan=plan, on_rollout=on_rollout, progress=False)
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "engine": cfg.rollout_engine,
        "engine_dtype": engine_dtype[0] if engine_dtype else None,
        "trainer_dtype": default_rollout_dtype(cuda),
        "logprob_gap_tolerance": logprob_gap_tolerance(cfg.rollout_dtype),
        "engine_flags": {"rollout_dtype": cfg.rollout_dtype, "colocate": cfg.colocate,
                         "rollout_enforce_eager": cfg.rollout_enforce_eager},
        "control_stale_sync": control_stale_sync,
        "rollouts": rows,
        "reward_per_rollout": [r["reward_mean"] for r in rows],
        "gap_initial": rows[0]["logprob_gap"] if rows else None,
        "gap_after_sync": [r["logprob_gap"] for r in rows[1:]],
        "generation_tokens_per_s": float(np.median([r["generation_tokens_per_s"] for r in rows])),
        "train_tokens_per_s": float(np.median([r["train_tokens_per_s"] for r in rows])),
        "peak_torch_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_device_used_bytes": device_peak.peak if cuda else None,
        "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "wall_s": time.perf_counter() - start,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.e2e_train")
    parser.add_argument("--out", default="runs/gpu-suite/e2e.json")
    parser.add_argument("--num-rollout", type=int, default=8)
    parser.add_argument("--control-stale-sync", action="store_true",
                        help="engines keep their weights: log the gap of a missed sync")
    args = parser.parse_args(argv)
    result = run_e2e(args.out, num_rollout=args.num_rollout,
                     control_stale_sync=args.control_stale_sync)
    print(json.dumps({k: v for k, v in result.items() if k != "rollouts"}, indent=1))
    if result["wall_s"] > TIME_LIMIT_S:
        print(f"e2e: {result['wall_s']:.0f} s exceeds the suite's {TIME_LIMIT_S} s budget",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
