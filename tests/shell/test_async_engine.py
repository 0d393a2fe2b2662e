"""The per-request engine API on the HF engine (``HfAsyncFront``), embedded tiny Qwen2.

Asserts: concurrent requests return what the batched ``HfEngine.generate`` returns for the same
seeds (tokens exactly, raw log-probs to float noise), also when requests join while others are
in flight and with a concurrency limit below the request count; an aborted request returns its
partial tokens and, resubmitted with the rest of its budget, continues them exactly (greedy);
stop tokens end a request; the weight version is recorded; a weight sync inside a request
(--pause-generation-mode in_place, retract) continues it exactly with the same weights, each
token carrying the version that sampled it, and retract continues on the new weights after a
recomputed prefill; abort ends the requests.
"""

import asyncio
from types import SimpleNamespace

import attrs
import pytest
import torch
from transformers.cache_utils import (DynamicLayer, LinearAttentionAndFullAttentionLayer,
                                      LinearAttentionLayer)

from vime_shell.engines import SamplingParams
from vime_shell.engines.async_engine import AsyncRolloutEngine, async_front
from vime_shell.engines.base import EngineError
from vime_shell.engines.hf import HfEngine
from vime_shell.engines.hf_async import _layer_kv
from vime_shell.models.tokenizer import load_tokenizer

PROMPTS = ["12>", "3+4=", "aabab#", "07=", "9>", "4455>"]


@pytest.fixture(scope="module")
def setup(embedded_pair):
    tok = load_tokenizer(embedded_pair[0])
    engine = HfEngine(embedded_pair[0], seed=0)
    return engine, [tok(p)["input_ids"] for p in PROMPTS]


async def _concurrent(front, prompts, params: SamplingParams, stagger: bool = False):
    async def one(i, p):
        if stagger:  # join while earlier requests are mid-generation
            for _ in range(i):
                await asyncio.sleep(0)
        return await front.generate(p, SamplingParams(**{**_fields(params),
                                                         "seed": params.request_seed(i)}))
    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def _fields(params: SamplingParams) -> dict:
    return attrs.asdict(params)


@pytest.mark.parametrize("concurrency,stagger,temperature", [
    (512, False, 1.0), (2, False, 1.0), (512, True, 1.0), (3, True, 0.0)])
def test_concurrent_requests_equal_the_batched_call(setup, concurrency, stagger, temperature):
    engine, prompts = setup
    params = SamplingParams(max_new_tokens=6, temperature=temperature, seed=11,
                            stop_token_ids=(1,))
    batched = engine.generate(prompts, params)
    front = async_front(engine, max_concurrency=concurrency)
    assert isinstance(front, AsyncRolloutEngine)
    gens = asyncio.run(_concurrent(front, prompts, params, stagger))
    assert [g.token_ids for g in gens] == [g.token_ids for g in batched]
    assert [g.finish_reason for g in gens] == [g.finish_reason for g in batched]
    for g, b in zip(gens, batched):
        assert max(abs(x - y) for x, y in zip(g.log_probs, b.log_probs)) < 1e-5
        assert g.weight_version == engine.weight_version
    assert front.in_flight == 0
    # samples of one call differ (seed + i): zero advantages otherwise
    assert len({g.token_ids for g in gens}) > 1 or temperature == 0


def test_an_aborted_request_continues_exactly(setup):
    engine, prompts = setup
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    full = engine.generate(prompts, params)
    front = async_front(engine, max_concurrency=4)

    async def abort_after(steps: int):
        tasks = [asyncio.create_task(front.generate(p, params)) for p in prompts]
        for _ in range(steps):
            await asyncio.sleep(0)
        assert front.abort_all() == len(prompts)
        return await asyncio.gather(*tasks)

    partial = asyncio.run(abort_after(3))
    assert all(g.finish_reason == "abort" for g in partial)
    assert any(0 < len(g.token_ids) < 8 for g in partial)  # some were mid-generation

    async def resume():
        return await asyncio.gather(*(
            front.generate(list(p) + list(g.token_ids),
                           SamplingParams(max_new_tokens=8 - len(g.token_ids), temperature=0.0))
            for p, g in zip(prompts, partial) if len(g.token_ids) < 8))

    rest = iter(asyncio.run(resume()))
    for g, f in zip(partial, full):
        tokens, logps = list(g.token_ids), list(g.log_probs)
        if len(tokens) < 8:
            r = next(rest)
            tokens += r.token_ids
            logps += r.log_probs
        assert tokens == list(f.token_ids)
        assert max(abs(a - b) for a, b in zip(logps, f.log_probs)) < 1e-5


def test_requests_in_a_later_event_loop_and_after_a_weight_version(setup):
    engine, prompts = setup
    front = async_front(engine, max_concurrency=8)
    params = SamplingParams(max_new_tokens=2, seed=3)
    first = asyncio.run(front.generate(prompts[0], params))
    engine.weight_version += 1
    second = asyncio.run(front.generate(prompts[0], params))
    engine.weight_version -= 1
    assert first.token_ids == second.token_ids
    assert (first.weight_version, second.weight_version) == (0, 1)


async def _synced_after(front, engine, prompts, params, steps: int, mode: str, load=None):
    """``prompts`` on ``front``, with a weight sync under ``mode`` after ``steps`` loop turns
    (``load()`` changes the weights, else only the version moves)."""
    tasks = [asyncio.create_task(front.generate(p, SamplingParams(
        **{**_fields(params), "seed": params.request_seed(i)}))) for i, p in enumerate(prompts)]
    for _ in range(steps):
        await asyncio.sleep(0)
    front.pause(mode)
    if load is not None:
        load()
    engine.weight_version += 1
    return await asyncio.gather(*tasks)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_sync_inside_a_request_continues_it_and_its_tokens_carry_both_versions(setup, mode):
    """--pause-generation-mode in_place / retract with the same weights: every request ends
    exactly as an uninterrupted one (tokens, and log-probs to float noise), and each token
    records the version that sampled it: the old one before the sync, the new one after."""
    engine, prompts = setup
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)
    plain = asyncio.run(_concurrent(async_front(engine, max_concurrency=8), prompts, params))
    before = engine.weight_version
    try:
        gens = asyncio.run(_synced_after(async_front(engine, max_concurrency=8), engine,
                                         prompts, params, 3, mode))
    finally:
        engine.weight_version = before
    assert [g.token_ids for g in gens] == [g.token_ids for g in plain]
    for g, p in zip(gens, plain):
        assert max(abs(a - b) for a, b in zip(g.log_probs, p.log_probs)) < 1e-5
        assert g.weight_version == before
        versions = list(g.token_versions)
        assert versions == sorted(versions) and set(versions) <= {before, before + 1}
    spanning = [g for g in gens if len(set(g.token_versions)) == 2]
    assert spanning  # the sync landed inside requests: two versions in one request


def test_a_retracted_request_continues_on_the_new_weights_after_a_recomputed_prefill(setup):
    """retract with new weights (greedy): the tokens before the sync are the old weights',
    those after are what the new weights generate from prompt + those tokens."""
    engine, prompts = setup
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    saved = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    moved = [(n, p * 1.3) for n, p in saved.items()]
    before = engine.weight_version
    try:
        gens = asyncio.run(_synced_after(
            async_front(engine, max_concurrency=8), engine, prompts, params, 3, "retract",
            load=lambda: engine.update_weights_from_tensors(moved)))
        for g, p in zip(gens, prompts):
            old = g.token_versions.count(before)
            if old == len(g.token_ids):
                continue  # ended before the sync
            rest = engine.generate([list(p) + list(g.token_ids[:old])], attrs.evolve(
                params, max_new_tokens=8 - old))[0]
            assert g.token_ids[old:] == rest.token_ids
            assert max(abs(a - b) for a, b in zip(g.log_probs[old:], rest.log_probs)) < 1e-5
    finally:
        engine.update_weights_from_tensors(saved.items())
        engine.weight_version = before


def test_an_abort_policy_ends_the_requests_in_flight(setup):
    engine, prompts = setup
    front = async_front(engine, max_concurrency=8)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    before = engine.weight_version
    try:
        gens = asyncio.run(_synced_after(front, engine, prompts, params, 3, "abort"))
    finally:
        engine.weight_version = before
    assert {g.finish_reason for g in gens} == {"abort"}
    assert all(set(g.token_versions) <= {before} for g in gens)
    with pytest.raises(EngineError, match="--pause-generation-mode='drain': is not a sync policy"):
        front.pause("drain")


def test_stop_controls_are_per_request(setup):
    engine, prompts = setup
    front = async_front(engine, max_concurrency=8, decode=lambda ids: "".join(map(chr, ids)))
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    full = engine.generate([prompts[0]], greedy)[0].token_ids
    stop_at = full[2]
    cut = full.index(stop_at) + 1
    stops = [attrs.evolve(greedy, stop_token_ids=(stop_at,)), greedy]
    if "stop" in attrs.fields_dict(SamplingParams):  # stop strings (--rollout-stop)
        stops.append(attrs.evolve(greedy, stop=(chr(stop_at),)))

    async def run():
        return await asyncio.gather(*(front.generate(prompts[0], p) for p in stops))
    gens = asyncio.run(run())
    assert gens[0].token_ids == full[:cut] and gens[0].finish_reason == "stop"
    assert gens[1].token_ids == full and gens[1].finish_reason == "length"
    if len(gens) > 2:
        assert gens[2].token_ids == full[:cut] and gens[2].finish_reason == "stop"


def test_a_linear_attention_cache_layer_is_an_error_never_dropped():
    """The front rebuilds its rows' cache from each layer's keys and values alone: a layer
    with linear-attention state (a hybrid model's) is a typed error, not state lost."""
    attention = DynamicLayer()
    keys, values = torch.zeros(1, 2, 3, 4), torch.ones(1, 2, 3, 4)
    attention.update(keys, values)
    kept = _layer_kv(SimpleNamespace(layers=[attention]))
    assert len(kept) == 1 and torch.equal(kept[0][0], keys) and torch.equal(kept[0][1], values)
    hybrid = LinearAttentionAndFullAttentionLayer()
    hybrid.update(keys, values)  # keys and values, and linear state besides
    for layer in (LinearAttentionLayer(), hybrid):
        with pytest.raises(EngineError, match=r"cache layer 1=.*Fix: generate with "
                                              r"--rollout-engine vllm"):
            _layer_kv(SimpleNamespace(layers=[attention, layer]))
