"""The per-request vLLM engine (``VllmAsyncEngine``, V1 ``AsyncLLM``) on vllm-cpu.

Skips without ``vllm``. One ``AsyncLLM`` (multiprocess, ~15 s to start) serves every test, with
the in-process ``vllm.LLM`` engine and the HF engine on the same weights as references.

Asserts: concurrent requests return what the batched ``LLM`` call returns for the same seeds
(tokens exactly, log-probs to 1e-5), also when called from two event loops in turn; a
request's top-4 ids and log-probs (``top_log_probs=4``) equal HF's; an aborted
greedy request returns its partial tokens and, resubmitted, continues them exactly; a weight
update from a directory bumps ``weight_version`` and greedy output follows the new weights; a
sync that meets a request (``--pause-generation-mode`` in_place, retract) continues it exactly
with the same weights, its tokens carrying both versions, and abort ends it; a call on the
engine's loop past its bound is an error naming it.
"""

import asyncio
import os
import threading

import numpy as np
import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vime_shell.engines import SamplingParams, select_engine  # noqa: E402
from vime_shell.engines.async_engine import AsyncRolloutEngine, async_front  # noqa: E402
from vime_shell.engines.base import EngineError  # noqa: E402
from vime_shell.engines.hf import HfEngine  # noqa: E402
from vime_shell.models.tokenizer import load_tokenizer  # noqa: E402

PROMPTS = ["12>", "34>", "56>", "78>", "90>", "aab#", "3+4=", "07="]


@pytest.fixture(scope="module")
def prompt_ids(embedded_pair):
    tokenizer = load_tokenizer(embedded_pair[0])
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def engine(embedded_pair):
    from vime_shell.engines.vllm_async import VllmAsyncEngine

    eng = VllmAsyncEngine(embedded_pair[0], seed=0, max_model_len=64, enforce_eager=True)
    yield eng
    eng.close()


def _seeded(params: SamplingParams, i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                          stop_token_ids=params.stop_token_ids, seed=params.request_seed(i))


def test_concurrent_requests_equal_the_batched_llm(engine, embedded_pair, prompt_ids):
    assert isinstance(engine, AsyncRolloutEngine) and async_front(engine) is engine
    params = SamplingParams(max_new_tokens=6, seed=21, stop_token_ids=(1,))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    batched_engine = select_engine("vllm", embedded_pair[0], seed=0, max_model_len=64,
                                   enforce_eager=True)
    try:
        batched = batched_engine.generate(prompt_ids, params)
    finally:
        batched_engine.close()

    async def concurrent():
        return await asyncio.gather(*(engine.generate(p, _seeded(params, i))
                                      for i, p in enumerate(prompt_ids)))
    for _ in range(2):  # two event loops in turn reach the same engine
        gens = asyncio.run(concurrent())
        assert [g.token_ids for g in gens] == [g.token_ids for g in batched]
        for g, b in zip(gens, batched):
            assert max(abs(x - y) for x, y in zip(g.log_probs, b.log_probs)) < 1e-5
            assert g.weight_version == 0
    assert len({g.token_ids for g in gens}) > 1
    assert engine.in_flight == 0


def test_a_request_reports_the_top_log_probs_hf_reports(engine, embedded_pair, prompt_ids):
    """A greedy request with ``top_log_probs=4`` reports the top-4 ids the HF engine reports for
    every token, most likely first, log-probs to 1e-5; with ``top_log_probs=0``, neither field."""
    params = SamplingParams(max_new_tokens=6, temperature=0.0, top_log_probs=4)
    gen = asyncio.run(engine.generate(prompt_ids[4], params))
    (ref,) = HfEngine(embedded_pair[0]).generate([prompt_ids[4]], params)
    assert gen.token_ids == ref.token_ids
    assert gen.top_token_ids.shape == (len(gen.token_ids), 4)
    np.testing.assert_array_equal(gen.top_token_ids, ref.top_token_ids)
    np.testing.assert_allclose(gen.top_log_probs, ref.top_log_probs, rtol=0, atol=1e-5)
    plain = asyncio.run(engine.generate(prompt_ids[4], SamplingParams(max_new_tokens=2,
                                                                      temperature=0.0)))
    assert plain.top_token_ids is None and plain.top_log_probs is None


def _streamed(engine, tokens: int) -> threading.Event:
    """An Event set once a request on ``engine`` has streamed ``tokens`` tokens: its
    ``AsyncLLM.generate`` (yielding the cumulative output after every engine step) wrapped on
    the instance; ``del engine._llm.generate`` restores it."""
    reached, stream = threading.Event(), engine._llm.generate

    async def watched(*args, **kwargs):
        async for out in stream(*args, **kwargs):
            if len(out.outputs[0].token_ids) >= tokens:
                reached.set()
            yield out
    engine._llm.generate = watched
    return reached


def test_an_aborted_request_continues_exactly(engine, prompt_ids):
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    prompt = prompt_ids[0]
    full = asyncio.run(engine.generate(prompt, params))
    assert len(full.token_ids) == 40  # no stop token: 38 engine steps left after the cut
    # The abort follows the second streamed token (an Event, not a sleep: at any load the
    # request is mid-generation), and reaches vLLM long before 38 more steps.
    reached = _streamed(engine, 2)

    async def cut():
        task = asyncio.create_task(engine.generate(prompt, params))
        assert await asyncio.to_thread(reached.wait, 120), "no token streamed in 120 s"
        assert engine.abort_all() == 1
        return await task

    try:
        partial = asyncio.run(cut())
    finally:
        del engine._llm.generate
    assert partial.finish_reason == "abort" and 2 <= len(partial.token_ids) < 40
    rest = asyncio.run(engine.generate(list(prompt) + list(partial.token_ids), SamplingParams(
        max_new_tokens=40 - len(partial.token_ids), temperature=0.0)))
    assert list(partial.token_ids) + list(rest.token_ids) == list(full.token_ids)
    logps = list(partial.log_probs) + list(rest.log_probs)
    assert max(abs(a - b) for a, b in zip(logps, full.log_probs)) < 1e-5


def test_a_weight_update_bumps_the_version(engine, embedded_pair, prompt_ids):
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    engine.update_weights_from_path(embedded_pair[1])
    try:
        gen = asyncio.run(engine.generate(prompt_ids[2], params))
        assert engine.weight_version == 1 and gen.weight_version == 1
        assert gen.token_ids == HfEngine(embedded_pair[1]).generate([prompt_ids[2]],
                                                                    params)[0].token_ids
    finally:
        engine.update_weights_from_path(embedded_pair[0])


def _met_by_a_sync(engine, prompt, params, sync):
    """``prompt`` on ``engine``, with ``sync()`` run on a thread once the request streamed 2
    tokens (an Event, not a sleep: at any load the request is mid-generation)."""
    reached = _streamed(engine, 2)

    async def run():
        task = asyncio.create_task(engine.generate(prompt, params))
        assert await asyncio.to_thread(reached.wait, 120), "no token streamed in 120 s"
        await asyncio.to_thread(sync)
        return await task

    try:
        return asyncio.run(run())
    finally:
        del engine._llm.generate


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_sync_inside_a_request_continues_it_and_its_tokens_carry_both_versions(
        engine, embedded_pair, prompt_ids, mode):
    """--pause-generation-mode through vLLM's pause_generation: a greedy request that a sync
    meets after its second streamed token (the same weights reloaded) ends as an uninterrupted
    one, and each token records the version that sampled it: 0 before the sync, 1 after."""
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    full = asyncio.run(engine.generate(prompt_ids[1], params))
    before = engine.weight_version

    def sync():
        engine.pause(mode)
        engine.update_weights_from_path(embedded_pair[0])
        engine.resume()

    try:
        gen = _met_by_a_sync(engine, prompt_ids[1], params, sync)
    finally:
        engine.weight_version = before
    assert gen.token_ids == full.token_ids and gen.finish_reason == full.finish_reason
    assert max(abs(a - b) for a, b in zip(gen.log_probs, full.log_probs)) < 1e-5
    versions = list(gen.token_versions)
    assert versions == sorted(versions) and set(versions) == {before, before + 1}
    assert versions.count(before) >= 2  # the tokens streamed before the sync


def test_an_abort_policy_ends_the_request_a_sync_meets(engine, prompt_ids):
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    touched = []

    def sync():
        touched.append(engine.pause("abort"))
        engine.resume()

    gen = _met_by_a_sync(engine, prompt_ids[3], params, sync)
    assert touched == [1]
    assert gen.finish_reason == "abort" and len(gen.token_ids) < 40
    assert engine.in_flight == 0


def test_an_engine_call_that_never_ends_is_an_error_naming_it(engine):
    """Every wait on the engine's loop is bounded: a call past its bound is cancelled and the
    error names it (a stuck engine process never holds the job)."""
    never = asyncio.Event()
    with pytest.raises(EngineError, match=r"did not finish its weight reload within 0\.2 s"):
        engine._call(never.wait(), "weight reload", 0.2)
    assert engine._call(asyncio.sleep(0, result=7), "check", 5) == 7  # the loop still serves
