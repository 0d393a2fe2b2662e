"""The agent session server against a direct engine call, in the same process and run.

On the char-level agent model (``build_agent_chat_model``) and the HF engine's per-request
front, one thread of torch:

- ``turn``: per-turn latency of one session's turn through the server (the ``openai`` client,
  HTTP, the session's token path, the engine) against ``front.generate`` of the same prompt;
  median of ``--turns`` sequential turns each, and the difference: the server's overhead;
- ``sessions``: ``--sessions`` concurrent sessions (default 256), one turn each, all at once:
  every one answered 200, and the wall time;
- ``rollout``: 64 executions of the example agent (``vime_shell.agents.lookup_example``, 1 or
  3 turns each) against the same turns as 64 direct engine calls per turn: wall times and
  their ratio.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src:. python -m benchmarks.agent_sessions`` (about a
minute on 2 cores; ``--quick``: fewer turns and sessions, the smoke test's run). Prints one
JSON line per measurement with the machine's load average.
"""

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from vime_pure.data.tool_calls import FORMATS
from vime_shell.agents.agent import closing_clients, openai_client
from vime_shell.agents.lookup_example import run_agent
from vime_shell.agents.server import shared_server
from vime_shell.agents.sessions import Execution
from vime_shell.engines.async_engine import async_front
from vime_shell.engines.base import SamplingParams
from vime_shell.engines.hf import HfEngine
from vime_shell.models.chat_model import build_agent_chat_model
from vime_shell.models.tokenizer import load_tokenizer
from vime_shell.rollout.generate import GenerateRuntime

PARAMS = SamplingParams(max_new_tokens=2, seed=3)


def _execution(key: str, front, tok) -> Execution:
    return Execution(key=key, runtime=GenerateRuntime(engine=front, tokenizer=tok),
                     loop=asyncio.get_running_loop(), tokenizer=tok, fmt=FORMATS["qwen"],
                     base=PARAMS, where="benchmark")


async def turns(front, tok, n: int) -> dict:
    """Sequential turns of one session, and the same prompts straight to the engine."""
    server = shared_server()
    url = server.open(_execution("turns", front, tok))
    messages = [{"role": "user", "content": "find"}]
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    served, direct = [], []
    async with openai_client(url) as client:
        for i in range(n):
            t = time.perf_counter()
            await client.chat.completions.create(model="vime", messages=[
                {"role": "user", "content": f"find{i % 10}"}], max_tokens=2)
            served.append(time.perf_counter() - t)
            t = time.perf_counter()
            await front.generate(ids, PARAMS)
            direct.append(time.perf_counter() - t)
    server.close("turns")
    s, d = statistics.median(served), statistics.median(direct)
    return {"served_ms": 1e3 * s, "direct_ms": 1e3 * d, "overhead_ms": 1e3 * (s - d)}


async def sessions(front, tok, n: int) -> dict:
    """``n`` sessions, one turn each, all in flight at once."""
    server = shared_server()
    urls = [server.open(_execution(f"s{i}", front, tok)) for i in range(n)]
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        t = time.perf_counter()
        replies = await asyncio.gather(*(http.post(f"{u}/chat/completions", json={
            "messages": [{"role": "user", "content": "find"}], "max_tokens": 2}) for u in urls))
        wall = time.perf_counter() - t
    for i in range(n):
        server.close(f"s{i}")
    return {"sessions": n, "ok": sum(r.status_code == 200 for r in replies), "wall_s": wall}


async def rollout(front, tok, executions: int = 64) -> dict:
    """The example agent's executions against the same number of turns sent directly."""
    server = shared_server()

    async def one(i: int) -> int:
        execution = _execution(f"r{i}", front, tok)
        url = server.open(execution)
        try:
            async with closing_clients():
                await run_agent(url, "find", {"max_tokens": 2}, {"execution_seed": i})
        finally:
            server.close(execution.key)
        return execution.turns

    t = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(executions)))
    served = time.perf_counter() - t
    ids = tok(tok.apply_chat_template([{"role": "user", "content": "find"}],
                                      add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    t = time.perf_counter()
    for k in range(max(counts)):  # the same turns, batched as the executions' were
        await asyncio.gather(*(front.generate(ids, PARAMS) for c in counts if c > k))
    direct = time.perf_counter() - t
    return {"executions": executions, "turns": sum(counts), "served_s": served,
            "direct_s": direct, "ratio": served / direct}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agent_sessions")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--sessions", type=int, default=256)
    args = parser.parse_args(argv)
    n_turns, n_sessions = (5, 16) if args.quick else (args.turns, args.sessions)
    model = build_agent_chat_model(Path(tempfile.mkdtemp()) / "agent")
    tok = load_tokenizer(model)
    front = async_front(HfEngine(model), max_concurrency=512)

    async def run() -> list[dict]:
        return [{"measure": "turn", **await turns(front, tok, n_turns)},
                {"measure": "sessions", **await sessions(front, tok, n_sessions)},
                {"measure": "rollout", **await rollout(front, tok)}]

    rows = asyncio.run(run())
    for row in rows:
        print(json.dumps({**row, "load": os.getloadavg()[0]}))
    return rows


if __name__ == "__main__":
    main()
