"""Workers of ``tests/shell/test_agent_train.py``: ``vime train`` with an agent
(``--custom-agent-function-path``) on the chat-template model, in each mode."""

import os
from pathlib import Path

import numpy as np
import openai

from tests.shell.loop_workers import TINY
from vime_shell.agents.server import subagent_url

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {}}}}]


async def fan_out_agent(base_url, prompt, request_kwargs, metadata, **kwargs):
    """Two turns on one path, a compacted history (a branch), and a sub-agent: three leaves
    per execution. The reward is the parity of the last reply's length (siblings share it)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="vime", max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    first = await client.chat.completions.create(model="vime", messages=messages, tools=TOOLS,
                                                 **request_kwargs)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "and then?"}]
    await client.chat.completions.create(model="vime", messages=messages, **request_kwargs)
    summary = [{"role": "user", "content": f"summary of {prompt}"}]
    last = await client.chat.completions.create(model="vime", messages=summary, **request_kwargs)
    sub = openai.AsyncOpenAI(base_url=subagent_url(base_url, "helper"), api_key="vime",
                             max_retries=0)
    await sub.chat.completions.create(model="vime", messages=[{"role": "user", "content": "1+1"}],
                                      **request_kwargs)
    return {"reward": float(len(last.choices[0].message.content or "") % 2),
            "metadata": {"agent": "fan_out", "tool_calls": 2}}  # its own count (2 helpers)


MODES = {"colocated": {"eval_interval": 1, "n_samples_per_eval_prompt": 2},
         "one_step_off": dict(colocate=False, rollout_num_gpus=1, train_async=True),
         "fully_async": dict(colocate=False, rollout_num_gpus=1, fully_async=True,
                             max_weight_staleness=1)}


def agent_worker(rank: int, root: str, model: str, mode: str) -> dict:
    """One run of ``mode`` (2 ranks): per rollout, the groups' sizes and mask totals."""
    os.environ.setdefault("VIME_CACHE_DIR", str(Path(root) / "cache"))
    from vime_shell.rollout.tasks import write_jsonl
    from vime_shell.run.driver import run_training
    from vime_shell.settings.train_config import TrainConfig

    data = write_jsonl(Path(root) / f"rows-{mode}-{rank}.jsonl",
                       [{"prompt": f"What is {a} + 1?", "label": str(a + 1)} for a in range(8)])
    extra = dict(MODES[mode])
    if "eval_interval" in extra:  # evaluation runs the agent through the server too
        extra["eval_prompt_data"] = ("held", str(data))
    cfg = TrainConfig(**{**TINY, "hf_checkpoint": model, "prompt_data": str(data),
                         "custom_agent_function_path":
                         "tests.shell.agent_workers:fan_out_agent",
                         "rollout_max_response_len": 4, "global_batch_size": 16,
                         "max_tokens_per_gpu": 512, "num_rollout": 2,
                         "run_dir": f"{root}/{mode}", **extra})
    seen: list = []

    def observe(e):
        batch = e.gather_batch()
        groups = batch.group_ids
        sizes = np.bincount(groups)
        masks = np.array([batch.sample_loss_mask(i).sum() for i in range(batch.num_samples)])
        totals = np.bincount(groups, weights=masks)
        seen.append({"sizes": sizes.tolist(), "mask_totals": totals[groups].tolist(),
                     "group_mask_sums": batch.group_mask_sums.tolist(),
                     "loss": e.metrics["loss"], "staleness_max": e.metrics["staleness_max"],
                     "eval": e.metrics.get("eval/held/reward_mean"),
                     "fan_out": e.metrics["samples_per_group_max"],
                     "tool_calls": e.metrics["tool_calls_per_group_mean"]})

    run_training(cfg, on_rollout=observe, progress=False)
    return {"rollouts": seen}
