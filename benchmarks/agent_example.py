"""The agent example trained from scratch on CPU: ``vime_shell.agents.lookup_example`` on the
char-level agent model, through the session server, colocated on one rank.

64 rows (half lookups, half ``=<d>`` warm-up copies), 8 prompts x 8 executions per rollout, one
optimizer step per rollout (``--global-batch-size 64``), ``--lr 5e-4``. Prints, every 25
rollouts, the mean reward per group over those rollouts, tool calls per execution (the
record's ``tool_calls_per_group_mean``) and the fan-out: samples per
execution, 3 for a lookup that called the tool, 1 otherwise (a warm-up row, or a lookup that
answered blind), so the share of 3-sample executions over the lookup rows' share of the data
is the tool-call rate; then the last 25 rollouts' mean reward and the distribution of samples
per execution. The reward of a lookup row is 0 without the tool call; see the example's
module docstring for the score.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src:. python -m benchmarks.agent_example`` (about 5
minutes on 2 cores; ``--rollouts N`` for a shorter run). Writes its JSON to
``benchmarks/results/agent_example.json``.
"""

import argparse
import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from vime_shell.agents.lookup_example import PROMPT, rows
from vime_shell.megatron.spawn import spawn
from vime_shell.models.chat_model import build_agent_chat_model
from vime_shell.rollout.tasks import write_jsonl
from vime_shell.run.driver import run_training
from vime_shell.settings.train_config import TrainConfig

RESULT = Path(__file__).with_name("results") / "agent_example.json"


def _worker(rank: int, root: str, rollouts: int) -> list[dict]:
    model = build_agent_chat_model(Path(root) / "model")
    data = write_jsonl(Path(root) / "rows.jsonl", rows(64))
    cfg = TrainConfig(hf_checkpoint=str(model), prompt_data=str(data),
                      custom_agent_function_path="vime_shell.agents.lookup_example:run_agent",
                      rollout_batch_size=8, n_samples_per_prompt=8, global_batch_size=64,
                      rollout_max_response_len=2, num_rollout=rollouts, lr=5e-4,
                      rollout_shuffle=True, run_dir=f"{root}/run")
    seen: list[dict] = []
    start = time.perf_counter()

    def observe(e) -> None:
        batch = e.gather_batch()
        _, first, sizes = np.unique(batch.group_ids, return_index=True, return_counts=True)
        seen.append({"rollout": e.rollout_id, "reward": float(batch.rewards[first].mean()),
                     "fan_out": [int(s) for s in sizes],
                     # the run's own record (metrics.jsonl): the agent reports its lookups
                     "tool_calls": e.metrics["tool_calls_per_group_mean"],
                     "seconds": time.perf_counter() - start})

    run_training(cfg, on_rollout=observe, progress=False)
    return seen


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agent_example")
    parser.add_argument("--rollouts", type=int, default=400)
    args = parser.parse_args(argv)
    seen = spawn(_worker, 1, tempfile.mkdtemp(prefix="vime-agent-"), args.rollouts)[0]
    window = 25
    curve = []
    for k in range(0, len(seen), window):
        part = seen[k:k + window]
        fan = [s for r in part for s in r["fan_out"]]
        curve.append({"rollouts": f"{part[0]['rollout']}-{part[-1]['rollout']}",
                      "reward": float(np.mean([r["reward"] for r in part])),
                      "samples_per_execution": float(np.mean(fan)),
                      "three_sample_executions": float(np.mean([s == 3 for s in fan])),
                      "tool_calls_per_execution": float(np.mean([r["tool_calls"]
                                                                 for r in part]))})
        print(json.dumps(curve[-1]))
    last = seen[-window:]
    lookup_share = float(np.mean([r["prompt"] == PROMPT for r in rows(64)]))
    out = {"rollouts": len(seen), "seconds": seen[-1]["seconds"], "lookup_rows": lookup_share,
           "first_reward": seen[0]["reward"],
           "last_25_reward": float(np.mean([r["reward"] for r in last])),
           "last_25_tool_calls_per_execution": float(np.mean([r["tool_calls"] for r in last])),
           "fan_out_last_25": dict(sorted(Counter(s for r in last
                                                  for s in r["fan_out"]).items())),
           "curve": curve, "load": os.getloadavg()[0]}
    print(json.dumps({k: v for k, v in out.items() if k != "curve"}))
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
