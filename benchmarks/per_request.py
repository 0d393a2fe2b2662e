"""The HF engine's per-request front against its batched ``generate``, same requests and seeds.

Workloads on the embedded model (one thread): ``demo``, 128 requests of the reverse2 prompt
shape x 2 new tokens (the demo's rollout); ``long``, 128 requests x 24 new tokens. Per
workload: median seconds of 5 repetitions of ``HfEngine.generate`` (one batched transformers
``generate`` call) and of 128 concurrent ``HfAsyncFront.generate`` calls (continuous batching
over one KV cache), their ratio, and whether the tokens are identical.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python -m benchmarks.per_request`` (``--quick``: 16
requests, one repetition, the test suite's smoke run).
"""

import argparse
import asyncio
import statistics
import time

from vime_shell.engines import SamplingParams
from vime_shell.engines.async_engine import async_front
from vime_shell.engines.hf import HfEngine
from vime_shell.models.embedded import build_embedded
from vime_shell.models.tokenizer import load_tokenizer
from vime_shell.rollout.data import PromptSource
from vime_shell.rollout.tasks import TASKS

REPEATS = 5


def _median(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.per_request")
    parser.add_argument("--quick", action="store_true")
    quick = parser.parse_args(argv).quick
    requests, repeats = (16, 1) if quick else (128, REPEATS)
    model = build_embedded()
    engine, tok = HfEngine(model), load_tokenizer(model)
    prompts = [tok(e.prompt)["input_ids"]
               for e in PromptSource.from_task(TASKS["reverse2"], seed=0).take(requests)]
    front = async_front(engine, max_concurrency=512)
    results = {}
    for name, new_tokens in (("demo", 2), ("long", 24)):
        params = SamplingParams(max_new_tokens=new_tokens, seed=7)

        async def concurrent(params=params):
            return await asyncio.gather(*(front.generate(p, SamplingParams(
                max_new_tokens=params.max_new_tokens, seed=params.request_seed(i)))
                for i, p in enumerate(prompts)))
        batched_s, batched = _median(lambda: engine.generate(prompts, params), repeats)
        front_s, per_request = _median(lambda: asyncio.run(concurrent()), repeats)
        same = [g.token_ids for g in batched] == [g.token_ids for g in per_request]
        results[name] = {"batched_s": batched_s, "per_request_s": front_s,
                         "ratio": front_s / batched_s, "identical_tokens": same}
        print(f"{name:5s} {requests} x {new_tokens:2d} tokens: batched {batched_s:.3f} s, "
              f"per-request {front_s:.3f} s (x{front_s / batched_s:.2f}), identical tokens: "
              f"{same}")
    return results


if __name__ == "__main__":
    main()
