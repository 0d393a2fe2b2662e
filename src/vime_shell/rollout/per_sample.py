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

Example: 4 prompts x 2 executions, ``target_groups=3``: the 3 groups that finish first are
returned, rewarded; the 4th goes to the buffer with one sample done and one aborted after 1 of
its 2 tokens; next rollout it runs first and its aborted sample generates 1 more token.
"""

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import attrs

from vime_pure.data.sample import Sample, Status
from vime_pure.errors import VimeError, field_error, one_line
from vime_shell.rollout.functions import RolloutContext, first_request
from vime_shell.rollout.generate import (RESUMED_AT, GenerateFn, GenerateRuntime, ResponseLimit,
                                         function_name, sampling_params_dict, use_limit,
                                         use_runtime)
from vime_shell.rollout.plugins import PluginError
from vime_shell.rollout.tasks import TaskError, TaskExample


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


@attrs.define(eq=False)
class PerSample:
    """How ``generate_rollout`` generates: the runtime (engine, tokenizer), the per-sample
    function, the run's config given to it as ``args``, the partial-rollout buffer (None: no
    partial rollouts), and ``runner``, which runs a round's executions to completion: a fresh
    event loop per call (``asyncio.run``), or a long-lived loop that several rounds share, as
    the fully-async pool's groups share its engine front (``vime_shell.loop.fully_async``)."""

    runtime: GenerateRuntime
    generate_fn: GenerateFn
    args: Any = None
    buffer: PartialBuffer | None = None
    runner: Callable[[Coroutine[Any, Any, Any]], Any] = asyncio.run


def _execution_done(samples: list[Sample]) -> bool:
    return all(s.status != Status.ABORTED for s in samples)


def _fresh_sample(example: TaskExample) -> Sample:
    """A sample not generated yet: no tokens, status aborted (i.e. unfinished)."""
    return Sample(tokens=[], response_length=0, loss_mask=[], rollout_log_probs=[],
                  status=Status.ABORTED,
                  metadata={**example.metadata, "prompt": example.prompt, "label": example.label,
                            "response": "", **({"tools": example.tools} if example.tools else {})})


def _as_leaf(out: Any, where: str) -> list[Sample]:
    samples = [out] if isinstance(out, Sample) else out
    if not isinstance(samples, (list, tuple)) or not samples \
            or not all(isinstance(s, Sample) for s in samples):
        raise field_error(PluginError, "--custom-generate-function-path", where,
                          f"returned {type(out).__name__}, not a Sample or a list of Samples",
                          "return the sample (or the fan-out's samples)")
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
    groups = (setup.buffer.take() if setup.buffer is not None else []) + [
        PromptGroup(example=e, executions=[[_fresh_sample(e)] for _ in range(n)],
                    finished=[False] * n)
        for e in ctx.prompts]
    first = first_request(ctx, sum(len(g.executions) for g in groups))
    target = ctx.target_groups if setup.buffer is not None else None
    order = setup.runner(_drive(ctx, setup, groups, first, target))
    if setup.buffer is None:
        complete = groups  # nothing is aborted from outside: train what the functions gave
    else:  # the first `target` groups to finish train; the rest waits, finished or not
        complete = [groups[i] for i in order[:target]]
        setup.buffer.groups.extend(g for g in groups if not any(g is c for c in complete))
    version = setup.runtime.engine.weight_version
    for p, g in enumerate(complete):
        _reward(ctx, g, where=f"prompt {ctx.prompt_offset + p}")
        for s in (s for e in g.executions for s in e):
            old = offpolicy_prefix(s, version)
            if setup.buffer is not None:
                setup.buffer.tokens += s.response_length
                setup.buffer.offpolicy_tokens += old
            if setup.runtime.mask_offpolicy and old:
                mask = [1] * s.response_length if s.loss_mask is None else list(s.loss_mask)
                s.loss_mask = [0] * old + mask[old:]
    return [g.executions for g in complete]


def offpolicy_prefix(sample: Sample, version: int) -> int:
    """How many leading response tokens of ``sample`` were generated under weights older than
    ``version``: all of them when its last segment is older, those before
    ``metadata["resumed_at"]`` when it was resumed under ``version``, else none.
    Example: versions ``[3, 4]``, resumed at 5 of 9 tokens: 5 at version 4, 9 at version 5."""
    versions = sample.weight_versions
    if not len(versions) or versions[0] >= version:
        return 0
    if versions[-1] < version:
        return sample.response_length
    return int(sample.metadata.get(RESUMED_AT, 0))


async def _drive(ctx: RolloutContext, setup: PerSample, groups: list[PromptGroup], first: int,
                 target: int | None) -> list[int]:
    """Run every execution; returns the indices of the groups in the order they finished
    (buffered groups that were already finished first)."""
    rt = setup.runtime
    order = [i for i, g in enumerate(groups) if g.done]
    finished = set(order)

    async def run(i: int, g: PromptGroup, k: int, r: int) -> None:
        gid = ctx.first_group_id + r
        if g.finished[k]:
            for s in g.executions[k]:
                s.group_id = gid
            return
        if len(g.executions[k]) != 1:  # a fan-out cut off mid-way: start it again
            setup.buffer.restarted += len(g.executions[k])
            g.executions[k] = [_fresh_sample(g.example)]
        sample = g.executions[k][0]
        sample.group_id, sample.index = gid, r
        params = sampling_params_dict(attrs.evolve(ctx.sampling,
                                                   seed=ctx.sampling.request_seed(r)))
        try:
            out = await setup.generate_fn(setup.args, sample, params)
        except asyncio.CancelledError:
            if not rt.aborting:
                raise  # not the partial rollout's cut: the driver itself is cancelled
            sample.status = Status.ABORTED  # cut mid-way: resumed from its state next time
            return
        except VimeError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the user's code; SystemExit(0) too
            name = getattr(setup.generate_fn, "__qualname__", repr(setup.generate_fn))
            kind = "exited with" if isinstance(exc, (SystemExit, KeyboardInterrupt)) else "raised"
            raise PluginError(f"execution {r} (prompt {one_line(repr(g.example.prompt))[:60]}): "
                              f"--custom-generate-function-path {name} {kind} "
                              f"{type(exc).__name__}: {one_line(str(exc))}. Fix: the generate "
                              "function (see the chained traceback).") from exc
        leaf = _as_leaf(out, f"execution {r}")
        for s in leaf:
            s.group_id = gid
        g.executions[k] = leaf
        g.finished[k] = _execution_done(leaf)
        if g.done and i not in finished:  # a sibling's task may have seen it first
            finished.add(i)
            order.append(i)
            if target is not None and len(order) >= target and not rt.aborting:
                rt.abort()

    # the function may lower the max_new_tokens it is given, never raise it (generate caps it)
    limit = ResponseLimit(ctx.sampling.max_new_tokens, function_name(setup.generate_fn))
    with use_runtime(rt), use_limit(limit):
        rt.resume()
        try:
            jobs, r = [], first
            for i, g in enumerate(groups):
                for k in range(len(g.executions)):
                    jobs.append(asyncio.ensure_future(run(i, g, k, r)))
                    r += 1
            rt.executions.update(jobs)
            if target is not None and len(order) >= target:
                rt.abort()
            # Cancelled before they started: their samples stay fresh (and wait in the buffer).
            results = await asyncio.gather(*jobs, return_exceptions=True)
            errors = [e for e in results if isinstance(e, BaseException)
                      and not (isinstance(e, asyncio.CancelledError) and rt.aborting)]
            if errors:
                raise errors[0]
        finally:
            rt.engine.abort_all()  # nothing outlives this event loop
            rt.executions.difference_update(jobs)
            rt.resume()
    return order


def _reward(ctx: RolloutContext, g: PromptGroup, *, where: str) -> None:
    samples = [s for e in g.executions for s in e]
    if all(s.reward is not None for s in samples):
        return
    rewards = iter(ctx.rewarder.score(samples, where=where))
    for execution in g.executions:
        values = [next(rewards) for _ in execution]
        for s in execution:
            s.reward = sum(values) / len(values)
