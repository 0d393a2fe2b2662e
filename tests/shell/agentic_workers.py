"""Process bodies for the per-sample (agentic) ``vime train`` tests: the multi-turn tool example
and a partial rollout, each a short run in one spawned process (imports dominate)."""

import asyncio
import contextvars
import os

import attrs
import numpy as np

from vime_pure.data.sample import Status
from vime_shell.engines.hf_async import HfAsyncFront
from vime_shell.rollout.generate import current_runtime, generate


async def slow_generate(args, sample, sampling_params):
    """One token per turn, the executions of prompt group ``g`` waiting ``g % 6 * 4`` loop
    ticks before each: a deterministic long tail, so a partial rollout cuts the slow groups
    mid-response (``args`` is the run's config)."""
    total = sampling_params["max_new_tokens"]
    group = sample.index // args.n_samples_per_prompt
    while sample.response_length < total:
        for _ in range(group % 6 * 4):
            await asyncio.sleep(0)
        sample = await generate(args, sample, {**sampling_params,
                                               "max_new_tokens": sample.response_length + 1})
        if sample.status is not Status.TRUNCATED:  # stopped (EOS) or aborted
            return sample
    return sample


# --fully-async --partial-rollout: a request made while _HOLD is set generates one token, then
# stays in flight in the engine until the next abort_all (the pool's cut at a weight sync)
# ends it, as a response longer than a training step does. So a run is sure to cut one.
_HOLD = contextvars.ContextVar("vime_test_hold", default=False)
_HELD: list = []  # this process: [True] once its one held request was made


def _hold_requests_in_the_front() -> None:
    """Patch this process's HF front once (inert unless ``_HOLD`` is set)."""
    if getattr(HfAsyncFront, "_vime_test_holds", False):
        return
    plain_generate, plain_abort = HfAsyncFront.generate, HfAsyncFront.abort_all
    waiting: list[asyncio.Future] = []

    async def held_generate(self, prompt_ids, params):
        if not _HOLD.get():
            return await plain_generate(self, prompt_ids, params)
        first = await plain_generate(self, prompt_ids, attrs.evolve(params, max_new_tokens=1))
        cut = asyncio.get_running_loop().create_future()
        waiting.append(cut)
        await cut
        return attrs.evolve(first, finish_reason="abort")  # its one token, its start version

    def abort_all(self):
        ended = plain_abort(self)
        for cut in waiting:
            if not cut.done():
                cut.set_result(None)
                ended += 1
        waiting.clear()
        return ended

    HfAsyncFront.generate, HfAsyncFront.abort_all = held_generate, abort_all
    HfAsyncFront._vime_test_holds = True


async def holding_generate(args, sample, sampling_params):
    """``slow_generate``, except that this engine rank's first request of a training group
    (block 1 on: never the probe, whose group ids are below one block's) under weights 1 to
    ``num_rollout - 2`` (a later sync is certain) stays in the engine until a sync cuts it;
    the pool then calls this function again with the sample as it was left."""
    _hold_requests_in_the_front()
    version = current_runtime().engine.weight_version
    training = sample.group_id >= args.rollout_batch_size * args.n_samples_per_prompt
    if not _HELD and training and 1 <= version <= args.num_rollout - 2 \
            and sample.response_length < sampling_params["max_new_tokens"]:
        _HELD.append(True)
        token = _HOLD.set(True)
        try:
            return await generate(args, sample, {**sampling_params,
                                                 "max_new_tokens": sample.response_length + 1})
        finally:
            _HOLD.reset(token)
    return await slow_generate(args, sample, sampling_params)


def _responses(batch):
    """Per sample: (prompt tokens, response tokens, response loss mask)."""
    out = []
    for i in range(len(batch.lengths)):
        start, end = batch.token_offsets[i], batch.token_offsets[i + 1]
        r = int(batch.response_lengths[i])
        r0 = batch.response_offsets[i]
        out.append((batch.tokens[start:end - r].tolist(), batch.tokens[end - r:end].tolist(),
                    batch.loss_masks[r0:r0 + r].tolist()))
    return out


def _partial_seen(e, batch) -> dict:
    return {"metrics": dict(e.metrics), "samples": _responses(batch),
            "versions": np.stack([batch.weight_version_min,
                                  batch.weight_version_max]).tolist(),
            "group_mask_sums": batch.group_mask_sums.tolist()}


def agentic_worker(rank: int, root: str, cache: str) -> dict:
    os.environ["VIME_CACHE_DIR"] = cache
    from tests.shell.loop_workers import _cfg
    from vime_shell.run.driver import run_training

    tool, partial = [], []
    run_training(_cfg(run_dir=f"{root}/tool", num_rollout=2, rollout_max_response_len=5,
                      custom_generate_function_path="vime_shell.rollout.tool_example:generate"),
                 on_rollout=lambda e: tool.append({"metrics": dict(e.metrics),
                                                   "samples": _responses(e.gather_batch())}),
                 progress=False)
    run_training(_cfg(run_dir=f"{root}/partial", num_rollout=3, rollout_max_response_len=4,
                      over_sampling_batch_size=6, partial_rollout=True,
                      mask_offpolicy_in_partial_rollout=True,
                      custom_generate_function_path="tests.shell.agentic_workers:slow_generate"),
                 on_rollout=lambda e: partial.append(_partial_seen(e, e.gather_batch())),
                 progress=False)
    return {"tool": tool, "partial": partial, **_put_back_runs(root)}


def _put_back_runs(root: str) -> dict:
    """A --partial-rollout run over a dataset of unique prompts, checkpointed after rollout 1
    with groups in its buffer, then resumed without --partial-rollout for rollout 2 (and, in
    between, the same resume under --fully-async, refused at launch)."""
    from tests.shell.loop_workers import _cfg
    from vime_shell.rollout.tasks import arithmetic_rows, write_jsonl
    from vime_shell.run.checkpoint_index import latest, waiting_groups
    from vime_shell.run.driver import run_training
    from vime_shell.run.launch_checks import check_run_paths

    rows = write_jsonl(f"{root}/data/train.jsonl", arithmetic_rows()[0])
    common = dict(prompt_data=str(rows), apply_chat_template=True, rollout_max_response_len=4,
                  run_dir=f"{root}/put-back", save=f"{root}/put-back-ck")
    seen: dict = {"put_back_first": [], "put_back_rest": []}

    def run(name: str, **kwargs) -> None:
        run_training(_cfg(**{**common, **kwargs}), progress=False, on_rollout=lambda e: seen[
            name].append({"metrics": dict(e.metrics),
                          "prompts": [p for p, _, _ in _responses(e.gather_batch())]}))

    run("put_back_first", num_rollout=2, over_sampling_batch_size=6, partial_rollout=True,
        custom_generate_function_path="tests.shell.agentic_workers:slow_generate")
    seen["put_back_waiting"] = waiting_groups(latest(common["save"]))
    try:
        check_run_paths(_cfg(**common, load=common["save"], fully_async=True,
                             rollout_num_gpus=1, num_rollout=3))
    except Exception as exc:  # noqa: BLE001 - the test reads the launch error
        seen["put_back_async"] = (type(exc).__name__, str(exc))
    run("put_back_rest", num_rollout=3, load=common["save"])
    return seen


def partial_engines_worker(rank: int, root: str, cache: str, rows: str,
                           phases: tuple[str, ...] = ("first", "rest")) -> dict:
    """``--partial-rollout`` on 2 colocated engines (one per rank) over ``rows``, a dataset of
    unique prompts: rollouts 0-1 checkpointed with groups left in both engines' buffers
    (``first``), then resumed on the same 2 engines for rollout 2 (``rest``), or on one engine
    for rollout 3 (``one_engine``, a world of 1); or the same on 2 engine ranks of their own
    (``separate``, a world of 3), or 3 rollouts there one step off (``one_step_off``). Returns per rollout the metrics and the trained prompts and
    masks (trainer ranks)."""
    os.environ["VIME_CACHE_DIR"] = cache
    from tests.shell.loop_workers import _cfg
    from vime_shell.run.checkpoint_index import latest, waiting_groups
    from vime_shell.run.driver import run_training

    common = dict(prompt_data=rows, apply_chat_template=True, rollout_max_response_len=4,
                  run_dir=f"{root}/engines", save=f"{root}/engines-ck", partial_rollout=True,
                  mask_offpolicy_in_partial_rollout=True, over_sampling_batch_size=6,
                  custom_generate_function_path="tests.shell.agentic_workers:slow_generate")
    seen: dict = {name: [] for name in phases}

    def run(name: str, **kwargs) -> None:
        run_training(_cfg(**{**common, **kwargs}), progress=False, on_rollout=lambda e: seen[
            name].append({"metrics": dict(e.metrics),
                          "prompts": [p for p, _, _ in _responses(e.gather_batch())],
                          "masks": [m for _, _, m in _responses(e.gather_batch())]}))

    if "first" in phases:
        run("first", num_rollout=2)
        seen["waiting"] = waiting_groups(latest(common["save"]))
    if "rest" in phases:
        run("rest", num_rollout=3, load=common["save"])
    if "one_engine" in phases:  # the same checkpoint on a world of 1: one engine takes all
        run("one_engine", num_rollout=4, load=common["save"])
    if "separate" in phases:  # 2 engine ranks of their own, synchronous, then resumed
        separate = dict(colocate=False, rollout_num_gpus=2, run_dir=f"{root}/separate",
                        save=f"{root}/separate-ck")
        run("separate", num_rollout=2, **separate)
        seen["separate_waiting"] = waiting_groups(latest(separate["save"]))
        run("separate", num_rollout=3, load=separate["save"], **separate)
    if "one_step_off" in phases:  # the same one step off (a carried group: K >= 2)
        run("one_step_off", num_rollout=3, colocate=False, rollout_num_gpus=2,
            train_async=True, max_weight_staleness=2, run_dir=f"{root}/one-step-off",
            save=f"{root}/one-step-off-ck")
    return seen
