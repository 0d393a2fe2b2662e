"""Per-sample generation (slime's ``generate(args, sample, sampling_params)``) and partial
rollouts, on the HF engine's per-request front and the embedded model.

Asserts: ``generate_rollout`` with the built-in ``generate`` returns the batched single-turn
rollout's samples (same seeds, same group ids); a fan-out function gives one rollout group per
call; under a partial rollout the first groups to finish train, the rest (whole groups) wait in
the buffer, and an aborted sample resumed under a new weight version continues its tokens
exactly (greedy) with both versions recorded, also through a checkpoint of the buffer (plain
JSON); with masking on its older tokens get loss mask
0 and the batch's group denominators count only the unmasked tokens; the plugin loader checks
the signature.
"""

import asyncio
import concurrent.futures as futures
import inspect
import json
import logging
import re
import threading
import time

import attrs
import numpy as np
import pytest

from vime_pure.data.batch import RolloutBatch
from vime_pure.data.rewards import RewardNormalization
from vime_pure.data.sample import Sample, Status
from vime_shell.engines import SamplingParams
from vime_shell.engines.async_engine import async_front
from vime_shell.engines.hf import HfEngine
from vime_shell.models.tokenizer import load_tokenizer
from vime_shell.rollout.data import PromptSource
from vime_shell.rollout.functions import RolloutContext, generate, single_turn_rollout
from vime_shell.rollout.generate import (GenerateError, GenerateRuntime, engine_params,
                                         sampling_params_dict)
from vime_shell.rollout.per_sample import (GenerateTimeoutError, PartialBuffer, PerSample,
                                           check_loop, generate_rollout)
from vime_shell.rollout.plugins import PluginError, load_generate_function
from vime_shell.rollout.rewards import Rewarder
from vime_shell.rollout.tasks import TASKS
from vime_shell.sources.pool import FrontEngine, GroupsFront, LockedEngine


@pytest.fixture(scope="module")
def parts(embedded_pair):
    tok = load_tokenizer(embedded_pair[0])
    engine = HfEngine(embedded_pair[0], seed=0)
    prompts = PromptSource.from_task(TASKS["reverse2"], seed=0).take(6)
    return engine, tok, prompts


def _ctx(parts, fn, *, buffer=None, mask=False, temperature=1.0, max_new=2, n=4, target=None):
    engine, tok, prompts = parts
    runtime = GenerateRuntime(engine=async_front(engine, max_concurrency=64, decode=tok.decode),
                              tokenizer=tok, mask_offpolicy=mask)
    return RolloutContext(
        rollout_id=0, engine=engine, tokenizer=tok, prompts=prompts, n_samples_per_prompt=n,
        sampling=SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=500,
                                stop_token_ids=(tok.eos_token_id,)),
        rewarder=Rewarder.build(rm_type="exact"), task=TASKS["reverse2"],
        per_sample=PerSample(runtime=runtime, generate_fn=fn, buffer=buffer),
        target_groups=target)


def _flat(output):
    return [s for prompt in output for execution in prompt for s in execution]


def test_builtin_generate_equals_the_batched_rollout(parts):
    ctx = _ctx(parts, generate)
    batched = [s for prompt in single_turn_rollout(ctx) for s in prompt]
    per_sample = _flat(generate_rollout(ctx))
    assert [s.tokens for s in per_sample] == [s.tokens for s in batched]
    assert [s.group_id for s in per_sample] == [s.group_id for s in batched]
    assert [s.reward for s in per_sample] == [s.reward for s in batched]
    assert all(s.weight_versions == [0] for s in per_sample)
    assert len({tuple(s.tokens) for s in per_sample}) > 1  # seeds differ per execution


async def fan_out(args, sample, sampling_params):
    """Two samples per execution: the answer, then a second answer to the same prompt."""
    first = await generate(args, sample, sampling_params)
    second = Sample(metadata=dict(sample.metadata))
    second = await generate(args, second, {**sampling_params, "sampling_seed": 7})
    return [first, second]


def test_a_fan_out_gives_one_group_per_call(parts):
    output = generate_rollout(_ctx(parts, fan_out, n=3))
    assert [len(p) for p in output] == [3] * len(parts[2])
    for prompt in output:
        for execution in prompt:
            assert len(execution) == 2 and execution[0].group_id == execution[1].group_id
            assert execution[0].reward == execution[1].reward
    batch = RolloutBatch.from_samples(output, normalization=RewardNormalization(method="grpo"))
    assert batch.num_groups == 3 * len(parts[2])


async def slow_generate(args, sample, sampling_params):
    """One token per call, execution ``index`` waiting ``index % 5`` loop ticks before each:
    a long tail in event-loop time, deterministic."""
    total = sampling_params["max_new_tokens"]
    while sample.response_length < total:
        for _ in range(sample.index % 5 * 3):
            await asyncio.sleep(0)
        step = {**sampling_params, "max_new_tokens": sample.response_length + 1}
        sample = await generate(args, sample, step)
        if sample.status is not Status.TRUNCATED:  # stopped (EOS) or aborted
            return sample
    return sample


@pytest.mark.parametrize("mask", [False, True])
def test_partial_rollout_resumes_exactly_and_masks_older_tokens(parts, mask):
    engine = parts[0]
    reference = _flat(generate_rollout(_ctx(parts, slow_generate, temperature=0.0, max_new=4)))
    buffer = PartialBuffer()
    first = generate_rollout(_ctx(parts, slow_generate, buffer=buffer, mask=mask,
                                  temperature=0.0, max_new=4, target=2))
    assert len(first) == 2 and len(buffer) == len(parts[2]) - 2  # whole groups wait
    waiting = [s for g in buffer.groups for e in g.executions for s in e]
    cut = [s for s in waiting if s.status is Status.ABORTED and s.response_length]
    assert cut, "some samples were cut mid-response"
    # what a checkpoint holds (plain JSON), then what a resumed run continues from
    buffer = PartialBuffer.from_state(json.loads(json.dumps(buffer.to_state())))
    engine.weight_version = 1  # the trainer synced (same weights: greedy must continue alike)
    try:
        ctx = attrs.evolve(_ctx(parts, slow_generate, buffer=buffer, mask=mask, temperature=0.0,
                                max_new=4, target=len(parts[2])), prompts=())
        second = generate_rollout(ctx)
    finally:
        engine.weight_version = 0
    assert len(buffer) == 0 and len(second) == len(parts[2]) - 2
    got = sorted(tuple(s.tokens) for s in _flat(first) + _flat(second))
    assert got == sorted(tuple(s.tokens) for s in reference)  # exactly continued
    resumed = [s for s in _flat(second) if s.weight_versions[:1] == [0] and 1 in s.weight_versions]
    assert resumed
    for s in resumed:
        prefix = s.weight_versions.count(0)  # segments of one token each under version 0
        expected = [0] * prefix + [1] * (s.response_length - prefix) if mask \
            else [1] * s.response_length
        assert s.loss_mask == expected
    old_finished = [s for s in _flat(second) if s.weight_versions == [0] * len(s.weight_versions)]
    for s in old_finished:  # finished before the sync: every token is off-policy
        assert s.loss_mask == ([0] * s.response_length if mask else [1] * s.response_length)
    batch = RolloutBatch.from_samples(second, normalization=RewardNormalization(method="grpo"))
    sums = [sum(s.loss_mask) for s in _flat(second)]
    np.testing.assert_array_equal(batch.group_mask_sums, sums)  # denominators follow masks


async def not_async(args, sample):
    return sample


def sync_generate(args, sample, sampling_params):
    return sample


@pytest.mark.parametrize("name,problem", [("sync_generate", "not an async function"),
                                          ("not_async", "does not take")])
def test_the_loader_checks_the_signature(name, problem):
    with pytest.raises(PluginError, match=problem):
        load_generate_function(f"tests.shell.test_per_sample:{name}")
    assert load_generate_function("vime_shell.rollout.functions:generate") is generate


def test_slime_sampling_dicts_round_trip_and_unknown_keys_are_errors():
    params = SamplingParams(max_new_tokens=3, temperature=0.5, top_k=4, seed=9,
                            stop_token_ids=(1,))
    d = sampling_params_dict(params)
    assert d["sampling_seed"] == 9 and d["stop_token_ids"] == [1]
    assert engine_params(d) == params
    assert engine_params({"max_new_tokens": 2, "top_k": -1, "no_stop_trim": True}).top_k == 0
    with pytest.raises(GenerateError, match="sampling_params"):
        engine_params({"max_new_tokens": 2, "n": 4})


async def broken(args, sample, sampling_params):
    raise KeyError("label")


def test_a_failing_generate_names_the_execution_and_the_flag(parts):
    ctx = _ctx(parts, broken)
    with pytest.raises(PluginError, match=r"^rollout 0, prompt 0 \('\d+>'\), execution 0: "
                                          r"--custom-generate-function-path tests.shell."
                                          r"test_per_sample:broken raised KeyError: 'label'\. "
                                          "Fix: ") as info:
        generate_rollout(ctx)
    assert isinstance(info.value.__cause__, KeyError) and str(info.value).count("Fix:") == 1
    assert ctx.per_sample.runtime.engine.in_flight == 0  # nothing left behind in the engine


async def stuck_tool(args, sample, sampling_params):
    """One token, then the executions of prompt groups 2+ wait on a tool that never answers
    (in 60 s: a failure, not a hang; the cut comes one loop tick after groups 0-1 finish)."""
    sample = await generate(args, sample, {**sampling_params, "max_new_tokens": 1})
    if sample.index >= 2 * 4 and sample.status is not Status.ABORTED:
        await asyncio.wait_for(asyncio.Event().wait(), timeout=60)
    return sample


def test_the_cut_cancels_executions_waiting_on_a_tool(parts):
    buffer = PartialBuffer()
    done = generate_rollout(_ctx(parts, stuck_tool, buffer=buffer, target=2))
    assert len(done) == 2 and len(buffer) == len(parts[2]) - 2
    waiting = [s for g in buffer.groups for e in g.executions for s in e]
    assert all(s.status is Status.ABORTED for s in waiting)
    assert all(s.response_length == 1 for s in waiting)  # the token before the tool is kept


async def raising_max_new_tokens(args, sample, sampling_params):
    """A plugin that asks for far more tokens than the run allows, and no stop token (so
    every response runs to whatever budget it gets)."""
    return await generate(args, sample, {**sampling_params, "max_new_tokens": 10000,
                                         "stop_token_ids": []})


async def awaits_forever(args, sample, sampling_params):
    """Execution 1 of prompt 0 waits on a tool that never answers; the others finish."""
    if sample.index == 1:
        await asyncio.sleep(3600)
    return await generate(args, sample, sampling_params)


async def blocks_the_loop(args, sample, sampling_params):
    """Execution 1 of prompt 0 calls a blocking sleep inside the coroutine: the event loop
    stops, so no asyncio timeout can fire."""
    if sample.index == 1:
        time.sleep(3600)
    return await generate(args, sample, sampling_params)


def _pool_runner(parts):
    """The fully-async pool's way: executions on the engine front's long-lived loop (its own
    thread), the round waited for from a pool thread."""
    engine, tok, _ = parts
    front = FrontEngine(engine, max_concurrency=64, decode=tok.decode)
    return front, GroupsFront(front.front)


def _round(ctx, mode, parts):
    if mode == "sync":
        return generate_rollout(ctx)
    front, shared = _pool_runner(parts)
    per_sample = attrs.evolve(ctx.per_sample, runner=front.submit, runtime=GenerateRuntime(
        engine=shared, tokenizer=ctx.per_sample.runtime.tokenizer))
    with futures.ThreadPoolExecutor(max_workers=1) as pool:  # a pool thread waits
        return pool.submit(generate_rollout, attrs.evolve(ctx, per_sample=per_sample)
                           ).result(timeout=120)


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
@pytest.mark.parametrize("fn, blocking", [(awaits_forever, False), (blocks_the_loop, True)])
def test_a_generate_that_never_returns_fails_at_its_deadline(parts, fn, blocking, mode):
    """``await asyncio.sleep(3600)`` and a blocking ``time.sleep(3600)`` alike: a typed error
    naming the plugin, the flag, the prompt and the execution, well before the hour."""
    ctx = _ctx(parts, fn)
    ctx = attrs.evolve(ctx, per_sample=attrs.evolve(ctx.per_sample, timeout=0.5))
    with pytest.raises(GenerateTimeoutError) as info:
        _round(ctx, mode, parts)
    message = str(info.value)
    assert message.startswith(f"rollout 0, prompt 0 ('{parts[2][0].prompt}'), execution 1: "
                              f"--custom-generate-function-path tests.shell.test_per_sample:"
                              f"{fn.__name__} did not return within --generate-timeout 0.5 s")
    assert ("blocks the event loop" in message) == blocking and message.count("Fix:") == 1


async def waits_on_a_tool(args, sample, sampling_params):
    await asyncio.Event().wait()  # never set


class _Lines(logging.Handler):
    def __init__(self, level: int = logging.NOTSET):
        super().__init__(level)
        self.lines: list[tuple[str, bool]] = []  # (message, logged on any rank)

    def emit(self, record):
        self.lines.append((record.getMessage(), getattr(record, "any_rank", False)))


def test_a_plugins_max_new_tokens_is_capped_at_the_run_limit_and_the_context_warned_once(
        parts):
    lines, logger = _Lines(logging.WARNING), logging.getLogger("vime.train")
    logger.addHandler(lines)
    try:
        ctx = _ctx(parts, raising_max_new_tokens, max_new=2)
        run_limit = _flat(generate_rollout(ctx))
        assert {s.response_length for s in run_limit} == {2}  # not 10000
        generate_rollout(ctx)  # a second round: no second warning
        # The model's context caps it too: 3 positions after the longest prompt.
        prompt_lens = [len(s.tokens) - s.response_length for s in run_limit]
        ctx = attrs.evolve(ctx, sampling=attrs.evolve(ctx.sampling, max_new_tokens=8))
        ctx.per_sample.runtime.context_len = max(prompt_lens) + 3
        in_context = _flat(generate_rollout(ctx))  # the same run: its cap warned already
    finally:
        logger.removeHandler(lines)
    assert [len(s.tokens) for s in in_context] == [max(prompt_lens) + 3] * len(in_context)
    limit, context = [message for message, _ in lines.lines]
    name = "--custom-generate-function-path tests.shell.test_per_sample:raising_max_new_tokens"
    assert limit.startswith(f'{name} set sampling_params["max_new_tokens"]=10000')
    assert "capped at 2 (--rollout-max-response-len" in limit
    assert context.startswith(f"{name}: max_new_tokens=8 after a ")
    assert f"the model's context of {max(prompt_lens) + 3} tokens" in context


def test_a_still_waiting_line_names_the_outstanding_execution(parts):
    """While an execution is outstanding, a line at a fixed interval (tiny here) names it,
    logged on whichever rank waits."""
    ctx = _ctx(parts, waits_on_a_tool, n=1)
    ctx = attrs.evolve(ctx, prompts=ctx.prompts[:1], per_sample=attrs.evolve(
        ctx.per_sample, timeout=1.0, report_every=0.05))
    lines = _Lines()
    logging.getLogger("vime.train").addHandler(lines)
    try:
        with pytest.raises(GenerateTimeoutError):
            generate_rollout(ctx)
    finally:
        logging.getLogger("vime.train").removeHandler(lines)
    waiting = [(m, any_rank) for m, any_rank in lines.lines if "still waiting" in m]
    assert waiting, lines.lines
    message, any_rank = waiting[0]
    assert any_rank and re.fullmatch(
        rf"rank \d+: rollout 0: still waiting for execution 0 of prompt 0 "
        rf"\('{parts[2][0].prompt}'\) \(\d+ s; 1 in flight; --generate-timeout 1 s\)", message)


async def interrupts_itself(args, sample, sampling_params):
    raise KeyboardInterrupt


def test_a_generate_functions_own_keyboard_interrupt_is_typed(parts):
    """Executions run on an event loop's thread, where no Ctrl-C lands: the function's own
    KeyboardInterrupt is a typed error, never an interrupted (or successful) run."""
    with pytest.raises(PluginError, match=r"execution 0: --custom-generate-function-path "
                                          r"\S+:interrupts_itself exited with KeyboardInterrupt"):
        generate_rollout(_ctx(parts, interrupts_itself))


async def returns_nothing(args, sample, sampling_params):
    return None


def test_a_wrong_return_names_the_plugin_and_the_prompt(parts):
    with pytest.raises(PluginError, match=r"^rollout 0, prompt 0 \('\d+>'\), execution 0: "
                                          r"--custom-generate-function-path \S+:returns_nothing "
                                          r"returned None, not a Sample"):
        generate_rollout(_ctx(parts, returns_nothing))


_BLOCKING = threading.Event()


async def signals_then_blocks(args, sample, sampling_params):
    """Execution 0 of prompt 0 says it is about to block the loop, then blocks it."""
    if sample.index == 0:
        _BLOCKING.set()
        time.sleep(3600)
    return await generate(args, sample, sampling_params)


def test_a_weight_load_waiting_on_a_blocked_loop_names_the_blocker(parts):
    """The fully-async pool loads weights on the front's loop: a generate function blocking it
    fails the load at --generate-timeout, naming that execution (not a silent hang)."""
    front, shared = _pool_runner(parts)
    ctx = _ctx(parts, signals_then_blocks)
    setup = attrs.evolve(ctx.per_sample, runner=front.submit, timeout=0.5, runtime=
                         GenerateRuntime(engine=shared, tokenizer=ctx.per_sample.runtime.tokenizer))
    with futures.ThreadPoolExecutor(max_workers=1) as pool:  # the pool thread of the round
        round_ = pool.submit(generate_rollout, attrs.evolve(ctx, per_sample=setup))
        assert _BLOCKING.wait(timeout=60)
        with pytest.raises(GenerateTimeoutError) as info:
            front.between_calls(lambda: None, check=lambda: check_loop(setup, front.loop))
        assert "execution 0: --custom-generate-function-path" in str(info.value)
        assert "blocks the event loop" in str(info.value)
        with pytest.raises(GenerateTimeoutError):
            round_.result(timeout=60)


def test_the_pools_two_engine_kinds_take_the_same_weight_load_call():
    """The pool holds a ``FrontEngine`` (engines with a per-request front) or a ``LockedEngine``
    (vLLM's offline ``LLM``) and loads weights through ``between_calls(fn, check=...)`` on
    either: the locked one waits for a running generate call, checking as it waits, and a check
    that raises ends the wait (a CI run on real vLLM once failed on a missing ``check``)."""
    assert (list(inspect.signature(LockedEngine.between_calls).parameters)
            == list(inspect.signature(FrontEngine.between_calls).parameters))
    locked = LockedEngine(object())
    assert locked.between_calls(lambda: 7, check=lambda: None) == 7
    checks = []
    with locked.lock:  # a generate call holds the engine
        def give_up() -> None:
            checks.append(1)
            raise GenerateTimeoutError("the engine stays busy")

        with pytest.raises(GenerateTimeoutError):
            locked.between_calls(lambda: 7, check=give_up)
    assert checks == [1]
    assert locked.between_calls(lambda: 8) == 8  # the lock was not left held
