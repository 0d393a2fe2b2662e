"""``vime train`` on a tiny Qwen3-MoE (the process body of ``test_moe_train_loop``).

:func:`build_moe_chat_model` writes a tiny Qwen3-MoE with the embedded char tokenizer, so the
loop's default task runs on it. :func:`moe_train_worker` runs ``vime train`` twice on the same
2-rank world: expert parallelism off (DP2) and ``--expert-model-parallel-size 2`` with
``--use-rollout-routing-replay`` (the HF engine's routes replayed). One optimizer step per
rollout, and the engines are synced before every rollout, so the replayed routes are those the
trainer's own weights choose: both runs must train alike.
"""

import os
from pathlib import Path

import numpy as np

from tests.shell.loop_workers import TINY


def build_moe_chat_model(path: str | Path) -> Path:
    """A 2-layer Qwen3-MoE (4 experts, top-2) over the embedded tokenizer's 19 tokens."""
    from vime_shell.models.embedded_build import build_tokenizer
    from vime_shell.models.tiny_model import TinyModelSpec, random_hf_model

    out = Path(path)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out)
    spec = TinyModelSpec(arch="qwen3_moe", vocab_size=20, num_layers=2, seed=4)
    random_hf_model(spec, pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id).save_pretrained(out)
    return out


def moe_train_worker(rank: int, root: str, hf_dir: str) -> dict:
    os.environ["VIME_CACHE_DIR"] = f"{root}/cache"
    from vime_shell.run.driver import run_training
    from vime_shell.settings.train_config import TrainConfig

    runs = {}
    for name, extra in (("dp2", {}), ("ep2_r3", dict(expert_model_parallel_size=2,
                                                     use_rollout_routing_replay=True))):
        seen: list = []

        def observe(event, seen=seen):
            batch = event.gather_batch()  # collective: every rank observes
            routes = batch.rollout_routed_experts
            seen.append({"metrics": dict(event.metrics),
                         "tokens": np.asarray(batch.tokens).copy(),
                         "routes": None if routes is None else routes.shape,
                         "state": {n: t.numpy().copy()
                                   for n, t in event.trainer.hf_state_dict().items()}})

        cfg = TrainConfig(**{**TINY, "global_batch_size": 16, "num_rollout": 2,
                             "hf_checkpoint": hf_dir, "rollout_engine": "hf",
                             "run_dir": f"{root}/{name}", **extra})
        run_training(cfg, on_rollout=observe, progress=False)
        runs[name] = seen
    return runs
