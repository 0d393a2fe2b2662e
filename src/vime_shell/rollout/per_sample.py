"""``generate_rollout``: the batched rollout function that runs a per-sample ``generate`` for
every execution concurrently, and partial rollouts (``--partial-rollout``).

``--custom-generate-function-path`` (or ``--rollout-function-path
vime_shell.rollout.per_sample:generate_rollout`` with the built-in
:func:`vime_shell.rollout.generate.generate`) makes each rollout round:

1. one prompt group per prompt: ``n_samples_per_prompt`` executions, execution ``r`` (the
   request's global number) starting from a fresh sample with ``index=r``, group id
   ``first_group_id + r`` and ``sampling_seed = sampling.seed + r``;
2. every execution is one ``await generate(args, sample, sampling_params)`` task, all in one
   event loop (the engine batches what is waiting at each forward); a returned list is a
   fan-out, one rollout group whose samples share the group id;
3. when a prompt group is complete (no sample aborted), it is rewarded: samples the function
   already rewarded keep theirs, else ``--rm-type`` / ``--custom-rm-path`` scores them and
   each execution gets the mean of its samples' rewards (siblings share one reward).

Partial rollouts (a :class:`PartialBuffer`): groups left unfinished in one rollout come back
first in the next. Once ``target_groups`` prompt groups are complete the runtime aborts
everything in flight: engine requests return their partial response (status aborted), and
executions busy elsewhere (a tool call, a sleep) are cancelled where they wait, their sample
keeping what it holds, so the cut never waits for a slow tool. Each unfinished group goes
whole to the buffer (a group trains only when all its
samples are done; its finished samples wait with it). Next rollout the buffered groups run
first, under the new weights: an aborted sample is continued where it stopped (the segment's
weight version is appended to ``Sample.weight_versions``; the function is called again with
the sample as it was left, so it must resume from the sample's state), a finished one is kept. A fan-out
execution that was cut off is restarted (its partial samples are counted in
``PartialBuffer.restarted``, never trained). With ``--mask-offpolicy-in-partial-rollout``
every token generated under older weights gets loss mask 0 (the batch's denominators follow
the masks, :mod:`vime_pure.denominators`).

In the fully-async pool (``--fully-async --partial-rollout``) nothing waits for a next
rollout: each weight sync cuts the engine requests in flight (``abort_all`` just before the
load, on the front's loop, so no request starts in between), and every execution that was cut
is called again at once under the new weights (``PerSample.continue_after_cut``). Its tokens
keep one weight version per segment, ``resumed_at`` marks the latest boundary, and the mask
above applies to them as to a buffered group's.

Deadlines (``--generate-timeout``, default ``functions.GENERATE_TIMEOUT_S``): each execution
(one call of the function) must return within that many seconds. The round's executions run on
an event loop of their own thread (:func:`fresh_loop`; in the fully-async pool, the engine
front's loop) and the thread that waits for the round watches them: an execution that runs
over stops the run with :class:`GenerateTimeoutError` naming the function, the flag, the
rollout, the prompt and the execution, whether it awaits forever (``await
asyncio.sleep(3600)``) or blocks the event loop (``time.sleep(3600)`` inside the coroutine,
which no ``asyncio`` timeout can interrupt: the step of its coroutine that runs on and on names
it). While executions are outstanding, one ``still waiting for execution k of prompt p`` line
per ``STILL_WAITING_S`` seconds (per process) names the oldest; it is logged by the rank that
waits, at every log level. The first execution to fail fails the round at once.

Example: 4 prompts x 2 executions, ``target_groups=3``: the 3 groups that finish first are
returned, rewarded; the 4th goes to the buffer with one sample done and one aborted after 1 of
its 2 tokens; next rollout it runs first and its aborted sample generates 1 more token.
"""

import asyncio
import concurrent.futures as futures
import logging
import os
import threading
import time
import types
from collections.abc import Callable, Coroutine
from typing import Any

import attrs

from vime_pure.data.sample import Sample, Status
from vime_pure.errors import VimeError, field_error, one_line
from vime_pure.token_versions import tokens_before
from vime_shell.rollout.functions import GENERATE_TIMEOUT_S, RolloutContext, first_request
from vime_shell.rollout.generate import (RESUMED_AT, GenerateFn, GenerateRuntime, ResponseLimit,
                                         function_name, sampling_params_dict, use_limit,
                                         use_runtime)
from vime_shell.rollout.plugins import PluginError, PluginTimeoutError, plugin_failure
from vime_shell.rollout.tasks import TaskError, TaskExample

FLAG = "--custom-generate-function-path"
STILL_WAITING_S = 60.0  # between two "still waiting" lines of one process
log = logging.getLogger("vime.train")


class GenerateTimeoutError(PluginTimeoutError):
    """An execution of the per-sample generate function that ran over ``--generate-timeout``."""


@attrs.define(eq=False)
class PromptGroup:
    """One prompt's executions: ``executions[k]`` are execution ``k``'s samples, and
    ``finished[k]`` says its function returned them with none aborted (statuses alone cannot
    tell: a multi-turn function updates them while it runs)."""

    example: TaskExample
    executions: list[list[Sample]]
    finished: list[bool]

    @property
    def done(self) -> bool:
        return all(self.finished)


@attrs.define(eq=False)
class PartialBuffer:
    """Unfinished prompt groups carried to the next rollout (``--partial-rollout``)."""

    groups: list[PromptGroup] = attrs.Factory(list)
    restarted: int = 0
    tokens: int = 0  # response tokens of the samples trained so far
    offpolicy_tokens: int = 0  # of which generated under older weights

    def __len__(self) -> int:
        return len(self.groups)

    def take(self) -> list[PromptGroup]:
        groups, self.groups = self.groups, []
        return groups

    def to_state(self) -> dict[str, Any]:
        """Plain JSON for a checkpoint: every waiting group with its samples (``to_dict``).
        Example: an empty buffer gives ``{"groups": [], "restarted": 0, ...}``."""
        return {"groups": [{"example": attrs.asdict(g.example), "finished": list(g.finished),
                            "executions": [[s.to_dict() for s in e] for e in g.executions]}
                           for g in self.groups],
                "restarted": self.restarted, "tokens": self.tokens,
                "offpolicy_tokens": self.offpolicy_tokens}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "PartialBuffer":
        """Inverse of :meth:`to_state` (a resumed run continues the waiting groups)."""
        groups = [PromptGroup(example=TaskExample(**g["example"]),
                              finished=[bool(f) for f in g["finished"]],
                              executions=[[Sample.from_dict(s) for s in e]
                                          for e in g["executions"]])
                  for g in state["groups"]]
        return cls(groups=groups, restarted=int(state["restarted"]),
                   tokens=int(state["tokens"]), offpolicy_tokens=int(state["offpolicy_tokens"]))


def fresh_loop(coro: Coroutine[Any, Any, Any]) -> futures.Future:
    """``coro`` on a new event loop in a daemon thread of its own (torn down as ``asyncio.run``
    does once ``coro`` is done); the caller waits on the returned future, with a bound."""
    loop = asyncio.new_event_loop()
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    future.add_done_callback(lambda _: loop.call_soon_threadsafe(loop.stop))
    threading.Thread(target=_serve_until_stopped, args=(loop,), daemon=True,
                     name="vime-generate").start()
    return future


def _serve_until_stopped(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
        rest = asyncio.all_tasks(loop)  # a cancelled round's tasks unwind before the close
        for task in rest:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()


@attrs.define(eq=False)
class PerSample:
    """How ``generate_rollout`` generates: the runtime (engine, tokenizer), the per-sample
    function (``name``: its path, as ``--custom-generate-function-path`` gave it), the run's
    config given to it as ``args``, the partial-rollout buffer (None: no partial rollouts),
    ``runner``, which starts a round's executions and returns the future of their end: a fresh
    event loop per round (:func:`fresh_loop`), or a long-lived loop that several rounds share,
    as the fully-async pool's groups share its engine front (``vime_shell.sources.pool``);
    ``timeout``: seconds one execution may take (``--generate-timeout``); ``report_every``:
    seconds between two "still waiting" lines; ``continue_after_cut``: an execution whose
    engine request a weight sync aborted (``GenerateRuntime.cuts`` moved while it ran: the
    fully-async pool under ``--partial-rollout``) is called again at once, in the same round,
    with the sample as it was left, so its next segment runs under the new weights."""

    runtime: GenerateRuntime
    generate_fn: GenerateFn
    args: Any = None
    buffer: PartialBuffer | None = None
    runner: Callable[[Coroutine[Any, Any, Any]], futures.Future] = fresh_loop
    name: str | None = None
    timeout: float = GENERATE_TIMEOUT_S
    report_every: float = STILL_WAITING_S
    continue_after_cut: bool = False

    @property
    def label(self) -> str:
        """``--custom-generate-function-path my.mod:fn`` (the flag and the function)."""
        fn = self.generate_fn
        name = self.name or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
        return f"{FLAG} {name}"


@attrs.define(eq=False)
class _Execution:
    """One execution in flight: execution ``k`` of ``prompt`` (``prompt 3 ('47>')``) in
    rollout ``rollout``, its event loop, when it started, and when the step of its coroutine
    now running started (None while it awaits): a step that runs on and on blocks its loop."""

    rollout: int
    prompt: str
    k: int
    loop: asyncio.AbstractEventLoop | None = None  # the one it runs on
    started: float = attrs.Factory(time.monotonic)
    step: float | None = None

    @property
    def where(self) -> str:
        return f"rollout {self.rollout}, {self.prompt}, execution {self.k}"


@types.coroutine
def _timed(coro: Coroutine[Any, Any, Any], execution: _Execution):
    """``await coro``, with the start of each of its steps in ``execution.step``."""
    value, error = None, None
    while True:
        execution.step = time.monotonic()
        try:
            future = coro.send(value) if error is None else coro.throw(error)
        except StopIteration as stop:
            return stop.value
        finally:
            execution.step = None
        try:
            value, error = (yield future), None
        except BaseException as exc:  # noqa: BLE001 - passed into the coroutine, as await does
            value, error = None, exc


@attrs.define(eq=False)
class _Round:
    """A round's executions in flight, as the thread waiting for the round sees them;
    ``submitted``: when the round was handed to its event loop; ``began``: whether one of its
    executions has started."""

    submitted: float = attrs.Factory(time.monotonic)
    running: set = attrs.Factory(set)
    began: bool = False  # an execution has started
    loop: asyncio.AbstractEventLoop | None = None  # its executions', once one started

    def start(self, execution: _Execution) -> _Execution:
        with _FLIGHT_LOCK:
            self.running.add(execution)
            _IN_FLIGHT.add(execution)
            self.began, self.loop = True, execution.loop
        return execution

    def stop(self, execution: _Execution) -> None:
        with _FLIGHT_LOCK:
            self.running.discard(execution)
            _IN_FLIGHT.discard(execution)

    def oldest(self) -> tuple[_Execution | None, int]:
        with _FLIGHT_LOCK:
            return min(self.running, key=lambda e: e.started, default=None), len(self.running)


# Every execution of this process in flight (an execution given up on that still blocks its
# loop stays here: it is still running), whatever its loop.
_IN_FLIGHT: set[_Execution] = set()
_FLIGHT_LOCK = threading.Lock()


def _blocker(now: float, at_least: float, loop: asyncio.AbstractEventLoop | None
             ) -> _Execution | None:
    """The execution on ``loop`` (None: any) whose current step has run longest, once that is
    ``at_least`` seconds: it blocks the loop (rounds of the fully-async pool share one)."""
    with _FLIGHT_LOCK:
        steps = [(now - e.step, e) for e in _IN_FLIGHT
                 if e.step is not None and (loop is None or e.loop is loop)]
    longest = max(steps, key=lambda x: x[0], default=(0.0, None))
    return longest[1] if longest[0] >= at_least else None


def check_loop(setup: PerSample, loop: asyncio.AbstractEventLoop) -> None:
    """For a thread waiting on ``loop``, where the executions run, for something else than a
    round (the fully-async pool's weight loads): :class:`GenerateTimeoutError` once one
    execution's step has blocked the loop for ``--generate-timeout`` seconds."""
    blocker = _blocker(time.monotonic(), setup.timeout, loop)
    if blocker is not None:
        raise GenerateTimeoutError(_late_message(blocker.where, True, setup, True))


_LAST_LINE = [0.0]  # when this process last logged a "still waiting" line
_LINE_LOCK = threading.Lock()


def _execution_done(samples: list[Sample]) -> bool:
    return all(s.status != Status.ABORTED for s in samples)


def _fresh_sample(example: TaskExample) -> Sample:
    """A sample not generated yet: no tokens, status aborted (i.e. unfinished)."""
    return Sample(tokens=[], response_length=0, loss_mask=[], rollout_log_probs=[],
                  status=Status.ABORTED,
                  metadata={**example.metadata, "prompt": example.prompt, "label": example.label,
                            "response": "", **({"tools": example.tools} if example.tools else {})})


def _as_leaf(out: Any, where: str, label: str) -> list[Sample]:
    samples = [out] if isinstance(out, Sample) else out
    if not isinstance(samples, (list, tuple)) or not samples \
            or not all(isinstance(s, Sample) for s in samples):
        raise PluginError(f"{where}: {label} returned {one_line(repr(out), 60)}, not a Sample "
                          f"or a list of Samples. Fix: make the function {FLAG} names return "
                          "the sample (or the fan-out's samples).")
    return list(samples)


def generate_rollout(ctx: RolloutContext) -> list[list[list[Sample]]]:
    """The round's complete prompt groups, ``output[p][k]`` = execution ``k``'s samples (see
    the module docstring). Needs ``ctx.per_sample`` (the loop sets it)."""
    setup: PerSample | None = ctx.per_sample
    if setup is None:
        raise field_error(TaskError, "per_sample", None, "is not set",
                          "run generate_rollout from vime train, or build RolloutContext("
                          "per_sample=PerSample(runtime=..., generate_fn=...))")
    n = ctx.n_samples_per_prompt
    buffered = setup.buffer.take() if setup.buffer is not None else []
    groups = buffered + [
        PromptGroup(example=e, executions=[[_fresh_sample(e)] for _ in range(n)],
                    finished=[False] * n)
        for e in ctx.prompts]
    names = [_prompt_name(ctx, i, len(buffered), g) for i, g in enumerate(groups)]
    first = first_request(ctx, sum(len(g.executions) for g in groups))
    target = ctx.target_groups if setup.buffer is not None else None
    flight = _Round()
    driver = _Driver(ctx=ctx, setup=setup, groups=groups, names=names, target=target,
                     flight=flight)
    order = _wait_round(setup.runner(driver.drive(first)),
                        setup, flight, ctx.rollout_id)
    if setup.buffer is None:
        complete = list(range(len(groups)))  # nothing is aborted from outside: train it all
    else:  # the first `target` groups to finish train; the rest waits, finished or not
        complete = order[:target]
        setup.buffer.groups.extend(g for i, g in enumerate(groups) if i not in complete)
    version = setup.runtime.engine.weight_version
    for i in complete:
        g = groups[i]
        _reward(ctx, g, where=f"rollout {ctx.rollout_id}, {names[i]}")
        samples = [s for e in g.executions for s in e]
        # The pool's rounds may end after a sync the group never saw: measure against its
        # newest segment there (the engine's version is that one in a synchronous round).
        reference = newest_version(samples) if setup.continue_after_cut else version
        for s in samples:
            old = offpolicy_prefix(s, reference)
            if setup.buffer is not None:
                setup.buffer.tokens += s.response_length
                setup.buffer.offpolicy_tokens += old
            if setup.runtime.mask_offpolicy and old:
                mask = [1] * s.response_length if s.loss_mask is None else list(s.loss_mask)
                s.loss_mask = [0] * old + mask[old:]
    return [groups[i].executions for i in complete]


def newest_version(samples: list[Sample]) -> int:
    """The newest weight version any segment of ``samples`` (one group) was generated under
    (0 when none was generated)."""
    return max((int(v) for s in samples for v in s.weight_versions), default=0)


def offpolicy_prefix(sample: Sample, version: int) -> int:
    """How many leading response tokens of ``sample`` were generated under weights older than
    ``version``: all of them when its last segment is older, those before
    ``metadata["resumed_at"]`` when it was resumed under ``version``, else none (with
    ``token_versions`` recorded: exactly, ``vime_pure.token_versions.tokens_before``).
    Example: versions ``[3, 4]``, resumed at 5 of 9 tokens: 5 at version 4, 9 at version 5."""
    if sample.token_versions is not None:  # recorded per token: exact
        return tokens_before(sample.token_versions, version)
    versions = sample.weight_versions
    if not len(versions) or versions[0] >= version:
        return 0
    if versions[-1] < version:
        return sample.response_length
    return int(sample.metadata.get(RESUMED_AT, 0))


def _prompt_name(ctx: RolloutContext, i: int, buffered: int, g: PromptGroup) -> str:
    """``prompt 3 ('47>')``: the round's prompt ``i`` (the buffered groups come first)."""
    text = one_line(repr(g.example.prompt), 40)
    if i < buffered:
        return f"a prompt buffered from an earlier rollout ({text})"
    return f"prompt {ctx.prompt_offset + i - buffered} ({text})"


def _wait_round(future: futures.Future, setup: PerSample, flight: _Round, rollout_id: int
                ) -> Any:
    """The round's result, waited for with the executions' deadline (module docstring): a
    late execution raises :class:`GenerateTimeoutError` (the round is cancelled), naming the
    execution that blocks the event loop if one does, else the late one; a round none of
    whose executions started is late ``timeout`` after it was handed to its loop. A "still
    waiting" line at most once per ``setup.report_every`` seconds per process."""
    while True:
        oldest, in_flight = flight.oldest()
        started = oldest.started if oldest is not None else (
            flight.submitted if not flight.began else time.monotonic())
        now = time.monotonic()
        until = min(now + setup.report_every, started + setup.timeout)
        done, _ = futures.wait([future], timeout=max(until - now, 0.0))
        if done:
            return future.result()
        oldest, in_flight = flight.oldest()
        now = time.monotonic()
        if oldest is None and flight.began:
            continue  # between two executions (or the round's end)
        if now - (flight.submitted if oldest is None else oldest.started) >= setup.timeout:
            future.cancel()  # its tasks are cancelled once the loop runs again
            blocker = _blocker(now, min(setup.timeout / 2, 10.0), flight.loop)
            late = blocker or oldest
            where = late.where if late is not None else f"rollout {rollout_id}"
            raise GenerateTimeoutError(_late_message(where, late is not None, setup,
                                                     blocker is not None))
        if oldest is not None and now - oldest.started >= setup.report_every:
            _still_waiting(oldest, now - oldest.started, in_flight, setup)


def _late_message(where: str, started: bool, setup: PerSample, blocking: bool) -> str:
    how = (" and blocks the event loop (a blocking call such as time.sleep inside the "
           "coroutine)" if blocking else "")
    fix = ("await asyncio.sleep, never time.sleep, and await blocking calls with "
           "asyncio.to_thread" if blocking else "bound its tool calls and waits")
    what = "did not return" if started else "did not start any execution (its loop is busy)"
    return (f"{where}: {setup.label} {what} within --generate-timeout {setup.timeout:g} s{how}. "
            f"Fix: make the function {FLAG} names return sooner ({fix}), or raise "
            "--generate-timeout.")


def _still_waiting(execution: _Execution, waited: float, in_flight: int,
                   setup: PerSample) -> None:
    with _LINE_LOCK:
        now = time.monotonic()
        if now - _LAST_LINE[0] < setup.report_every:
            return
        _LAST_LINE[0] = now
    log.warning("rank %s: rollout %d: still waiting for execution %d of %s (%.0f s; %d in "
                "flight; --generate-timeout %g s)", os.environ.get("RANK", "0"),
                execution.rollout, execution.k, execution.prompt, waited, in_flight,
                setup.timeout, extra={"any_rank": True})


@attrs.define(eq=False)
class _Driver:
    """One round's executions on its event loop (:meth:`drive`): ``order`` collects the
    indices of the groups in the order they finished (buffered groups that were already
    finished first); a round under ``target`` aborts the rest once that many finished."""

    ctx: RolloutContext
    setup: PerSample
    groups: list[PromptGroup]
    names: list[str]
    target: int | None
    flight: _Round
    order: list[int] = attrs.Factory(list)
    finished: set[int] = attrs.Factory(set)

    async def drive(self, first: int) -> list[int]:
        """Run every execution (each one in ``flight`` while it runs), request numbers from
        ``first`` on. A failing execution fails the round at once, the others cancelled."""
        rt, setup, target = self.setup.runtime, self.setup, self.target
        self.order = [i for i, g in enumerate(self.groups) if g.done]
        self.finished = set(self.order)
        # the function may lower the max_new_tokens it is given, never raise it (generate
        # caps it)
        limit = ResponseLimit(self.ctx.sampling.max_new_tokens, function_name(setup.generate_fn))
        with use_runtime(rt), use_limit(limit):
            rt.resume()
            jobs: list[asyncio.Future] = []
            try:
                r = first
                for i, g in enumerate(self.groups):
                    for k in range(len(g.executions)):
                        jobs.append(asyncio.ensure_future(self.run(i, g, k, r)))
                        r += 1
                rt.executions.update(jobs)
                if target is not None and len(self.order) >= target:
                    rt.abort()
                await _first_error(jobs, rt)
            finally:
                rt.engine.abort_all()  # nothing outlives this event loop
                rt.executions.difference_update(jobs)
                rt.resume()
        return self.order

    async def run(self, i: int, g: PromptGroup, k: int, r: int) -> None:
        """Execution ``k`` of group ``i`` (request ``r``) until it is done, cut by the
        partial rollout's end, or aborted by no cut of ours."""
        rt = self.setup.runtime
        gid = self.ctx.first_group_id + r
        while not g.finished[k]:
            cuts = rt.cuts
            if not await self.call(i, g, k, r, gid):
                return  # cut by the partial rollout's end: resumed from its state next time
            if not (self.setup.continue_after_cut and rt.cuts != cuts):
                break  # done, or aborted by no cut of ours: it stays as returned
            # a weight sync cut its request (the fully-async pool): continue it now, under
            # the new weights, as a buffered group is continued in the next rollout
        for s in g.executions[k]:
            s.group_id = gid
        if g.done and i not in self.finished:  # a sibling's task may have seen it first
            self.finished.add(i)
            self.order.append(i)
            if self.target is not None and len(self.order) >= self.target \
                    and not rt.aborting:
                rt.abort()

    async def call(self, i: int, g: PromptGroup, k: int, r: int, gid: int) -> bool:
        """One call of the function for execution ``k`` of group ``i``; False when the
        partial rollout's end cancelled it."""
        setup, rt, ctx = self.setup, self.setup.runtime, self.ctx
        if len(g.executions[k]) != 1:  # a fan-out cut off mid-way: start it again
            if setup.buffer is not None:  # counted where the run's checkpoint keeps it
                setup.buffer.restarted += len(g.executions[k])
            else:
                rt.restarted += len(g.executions[k])
            g.executions[k] = [_fresh_sample(g.example)]
        sample = g.executions[k][0]
        sample.group_id, sample.index = gid, r
        params = sampling_params_dict(attrs.evolve(ctx.sampling,
                                                   seed=ctx.sampling.request_seed(r)))
        execution = self.flight.start(_Execution(ctx.rollout_id, self.names[i], k,
                                                 asyncio.get_running_loop()))
        try:
            out = await _timed(setup.generate_fn(setup.args, sample, params), execution)
        except asyncio.CancelledError:
            if not rt.aborting:
                raise  # not the partial rollout's cut: the driver itself is cancelled
            sample.status = Status.ABORTED  # cut mid-way: resumed from its state next time
            return False
        except VimeError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the user's code; SystemExit(0) too
            raise PluginError(plugin_failure(execution.where, setup.label, FLAG, exc)) from exc
        finally:
            self.flight.stop(execution)
        g.executions[k] = _as_leaf(out, execution.where, setup.label)
        g.finished[k] = _execution_done(g.executions[k])
        return True


async def _first_error(jobs: list[asyncio.Future], rt: GenerateRuntime) -> None:
    """Wait for every execution; the first one to fail is raised at once, the others
    cancelled. Executions the partial rollout's cut cancelled before they started are no
    failure (their samples stay fresh and wait in the buffer)."""
    pending = set(jobs)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        errors = [e for t in jobs if t in done and not t.cancelled()
                  and (e := t.exception()) is not None]  # the first in execution order
        if not errors and any(t.cancelled() for t in done) and not rt.aborting:
            errors = [asyncio.CancelledError()]
        if errors:
            for task in pending:
                task.cancel()
            raise errors[0]


def _reward(ctx: RolloutContext, g: PromptGroup, *, where: str) -> None:
    samples = [s for e in g.executions for s in e]
    if all(s.reward is not None for s in samples):
        return
    rewards = iter(ctx.rewarder.score(samples, where=where))
    for execution in g.executions:
        values = [next(rewards) for _ in execution]
        for s in execution:
            s.reward = sum(values) / len(values)
