"""Process bodies for the ``vime train`` loop tests (importable, so ``spawn`` can run them).

Each worker runs one or more short trainings in a fresh process and returns plain, picklable
observations; the tests assert on them. ``TINY`` is the shared small configuration: 4 prompts
x 4 samples = 16 groups, 2 optimizer steps of 8 groups, micro-batches capped at 24 tokens (so
a step has several micro-batches per rank), rewarded by ``first_char_reward``.
"""

import os
import signal

import numpy as np

TINY = dict(rollout_batch_size=4, n_samples_per_prompt=4, global_batch_size=8,
            max_tokens_per_gpu=24, lr=1e-3, seed=3,
            custom_rm_path="tests.shell.loop_workers:first_char_reward")


def first_char_reward(sample) -> float:
    """Partial credit (right first character): an untrained model earns some reward in 16
    samples (~1/19 each), so advantages are non-zero and the parameters move."""
    meta = sample.metadata
    return float(meta["response"][:1] == meta["label"][:1])


def _cfg(**kwargs):
    from vime_shell.settings.train_config import TrainConfig

    return TrainConfig(**{**TINY, **kwargs})


def _observe(event, out: list, *, engine_check: bool = False) -> None:
    """Record what a test needs from one rollout (on this rank)."""
    from megatron.core import parallel_state as mpu

    sched = event.schedule
    batch = event.gather_batch()  # collective: every rank observes
    rank = mpu.get_data_parallel_rank()
    item = {"rollout": event.rollout_id, "metrics": dict(event.metrics), "dp_rank": rank,
            "trace": [(s, tuple(ix), n) for s, ix, n in event.trace],
            "plan": [[tuple(mb.sample_indices.tolist()) for mb in step.microbatches]
                     for step in event.records.steps],
            "steps": [[[tuple(mb) for mb in r] for r in step.microbatches]
                      for step in sched.steps],
            "partition": tuple(sched.partitions[rank]),
            "group_ids": batch.original_group_ids(),
            "tokens": np.asarray(batch.tokens).copy(),
            "advantages": np.asarray(batch.advantages).copy(),
            "rollout_log_probs": (None if batch.rollout_log_probs is None
                                  else np.asarray(batch.rollout_log_probs).copy()),
            "has_engine": event.engine is not None}
    if engine_check:
        state = event.trainer.hf_state_dict()  # collective: every rank calls it
        engine = getattr(event, "engine", None)
        if engine is not None:
            params = dict(engine.model.named_parameters())
            item["engine_vs_trainer"] = max(float((params[n] - t).abs().max())
                                            for n, t in state.items())
        item["state"] = {n: t.numpy().copy() for n, t in state.items()}
    out.append(item)


def loop_worker(rank: int, run_dir: str, cache: str, kwargs: dict) -> dict:
    """One run of ``kwargs`` (on top of ``TINY``); engine/trainer weights after each sync,
    and each rollout's optimizer steps' gradient norms (``step_grad_norms``)."""
    os.environ["VIME_CACHE_DIR"] = cache
    from vime_shell.megatron.trainer import MegatronTrainer
    from vime_shell.run.driver import run_training

    seen: list = []
    norms: list = []
    train = MegatronTrainer.train

    def recording(self, *args, **kw):
        results = train(self, *args, **kw)
        norms.append([r.grad_norm for r in results])
        return results

    MegatronTrainer.train = recording
    try:
        result = run_training(_cfg(run_dir=run_dir, **kwargs),
                              on_rollout=lambda e: _observe(e, seen, engine_check=True),
                              progress=False)
    finally:
        MegatronTrainer.train = train
    for item, steps in zip(seen, norms):
        item["step_grad_norms"] = steps
    return {"rollouts": seen, "hf_dir": str(result.hf_checkpoint)}


def replay_worker(rank: int, root: str, cache: str) -> dict:
    """Original run with dumps, then train-only replay, forge replay and a fallback replay."""
    os.environ["VIME_CACHE_DIR"] = cache
    from vime_shell.run.driver import run_training

    template = f"{root}/dumps/r{{rollout_id}}.npz"
    runs = {}
    for name, kwargs in (
            ("original", dict(save_rollout_data=template)),
            ("train_only", dict(load_rollout_data=template)),
            ("forge", dict(load_rollout_data=template, load_rollout_data_mode="forge")),
            ("fallback", dict(load_rollout_data=f"{root}/dumps/r{{rollout_id}}.npz",
                              load_rollout_data_fallback=True, num_rollout=3))):
        seen: list = []
        run_training(_cfg(run_dir=f"{root}/{name}", **{"num_rollout": 2, **kwargs}),
                     on_rollout=lambda e, seen=seen: _observe(e, seen), progress=False)
        runs[name] = seen
    return runs


def world_size_1_worker(rank: int, root: str, cache: str, dump: str) -> dict:
    """Three runs in one process (imports dominate a short run): the default single-turn
    loop, the compact multi-turn loop, and a train-only replay of one hand-made batch."""
    fixed = dict(load_rollout_data=dump, num_rollout=1,
                 rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4,
                 max_tokens_per_gpu=16)
    multi_turn = dict(num_rollout=2, rollout_function_path="vime_shell.rollout.functions:compact_rollout",
                      rollout_num_turns=2)
    return {"single": loop_worker(rank, f"{root}/single", cache, {"num_rollout": 3}),
            "multi_turn": loop_worker(rank, f"{root}/multi", cache, multi_turn),
            "fixed": loop_worker(rank, f"{root}/fixed", cache, fixed)}


def _single_process(cache: str, port: int) -> None:
    """A world of one for a process started without ``spawn`` (so it can be SIGKILLed)."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      VIME_CACHE_DIR=cache)
    import torch

    torch.set_num_threads(1)


def killed_worker(root: str, cache: str, port: int, kill_after: int) -> None:
    """Run 4 rollouts with checkpoints every 2 and SIGKILL this process after ``kill_after``."""
    _single_process(cache, port)
    from vime_shell.run.driver import run_training

    def hook(event):
        if event.rollout_id == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    run_training(_cfg(**resume_kwargs(root, "interrupted", resume=False)), on_rollout=hook,
                 progress=False)


def killed_in_save_worker(root: str, cache: str, port: int) -> None:
    """Run 4 rollouts with checkpoints every 2 and SIGKILL this process inside the second
    save, once its tensor shards are on disk and before the checkpoint is complete."""
    _single_process(cache, port)
    from vime_shell.megatron import torch_dist
    from vime_shell.run.driver import run_training

    write_shards, saves = torch_dist.SyncTorchDistSave.save, []

    def save_then_die(self, sharded_state_dict, checkpoint_dir):
        write_shards(self, sharded_state_dict, checkpoint_dir)
        saves.append(checkpoint_dir)
        if len(saves) == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    torch_dist.SyncTorchDistSave.save = save_then_die
    run_training(_cfg(**resume_kwargs(root, "killed_in_save", resume=False)), progress=False)


def resume_kwargs(root: str, name: str, resume: bool) -> dict:
    """A new run passes --save only; its resumption adds --load of the same directory."""
    return dict(num_rollout=4, save=f"{root}/{name}/ckpt",
                load=f"{root}/{name}/ckpt" if resume else None,
                save_interval=2, run_dir=f"{root}/{name}/run",
                save_rollout_data=f"{root}/{name}/dumps/r{{rollout_id}}.npz")


def resume_worker(rank: int, root: str, cache: str, names: tuple[str, ...]) -> dict:
    """Run (or resume, from its ``--save`` directory) each of ``names`` in turn: the
    uninterrupted run, then the killed ones; final weights of each."""
    os.environ["VIME_CACHE_DIR"] = cache
    from vime_shell.run.driver import run_training

    out = {}
    for name in names:
        final: dict = {}

        def hook(event, final=final):
            if event.rollout_id == 3:
                final.update({n: t.numpy().copy()
                              for n, t in event.trainer.hf_state_dict().items()})

        result = run_training(_cfg(**resume_kwargs(root, name, resume=name != "uninterrupted")),
                              on_rollout=hook, progress=False)
        out[name] = {"start": result.start_rollout, "final": final,
                     "ran": [r["rollout"] for r in result.records]}
    return out


def save_hf_worker(rank: int, root: str, cache: str, probe: np.ndarray,
                   options: dict | None = None) -> dict:
    """Train 2 rollouts with ``--save-hf`` (and ``options``, more settings); Megatron log-probs
    of ``probe`` after the last one, and each rollout's metrics."""
    os.environ["VIME_CACHE_DIR"] = cache
    from vime_pure import (BatchingPolicy, ParallelLayout, RolloutBatch, Sample, rank_batch,
                           schedule_for)
    from vime_shell.run.driver import run_training

    n, length = probe.shape
    batch = RolloutBatch.from_samples([[Sample(tokens=row.tolist(), response_length=length - 1,
                                               reward=0.0)] for row in probe])
    records = rank_batch(batch, schedule_for(batch, ParallelLayout(dp=1), BatchingPolicy(
        global_batch_size=n, micro_batch_size=1)), dp_rank=0)
    seen: dict = {"metrics": []}

    def hook(event):
        seen["metrics"].append(dict(event.metrics))
        logps = event.trainer.compute_log_probs(records.microbatches, records.num_response_tokens)
        seen["log_probs"] = logps.reshape(n, length - 1)
        seen["state"] = {k: t.numpy().copy() for k, t in event.trainer.hf_state_dict().items()}

    result = run_training(_cfg(run_dir=f"{root}/run", num_rollout=2, save_hf=f"{root}/hf",
                               save_hf_max_shard_size="300KB", **(options or {})),
                          on_rollout=hook, progress=False)
    return {**seen, "hf_dir": str(result.hf_checkpoint)}


def real_jobs_worker(rank: int, root: str, cache: str) -> dict:
    """Issue-12 features on the embedded model, one process: a KL run against the reference
    model, an arithmetic dataset run with dynamic sampling, eval and a checkpoint."""
    os.environ["VIME_CACHE_DIR"] = cache
    import json
    from pathlib import Path

    from vime_shell.rollout.tasks import arithmetic_rows, write_jsonl
    from vime_shell.run.driver import run_training

    out: dict = {}
    kl_seen: list = []

    def reference_state(event):
        kl_seen.append(dict(event.metrics))
        if event.rollout_id == 1:  # the frozen reference after two updates of the policy
            named = event.trainer.bridge.export_weights(event.trainer.reference)
            out["reference"] = {n: t.detach().numpy().copy() for n, t in named}
            out["policy"] = {n: t.numpy().copy()
                             for n, t in event.trainer.hf_state_dict().items()}

    result = run_training(_cfg(run_dir=f"{root}/kl", num_rollout=2, global_batch_size=16,
                               use_kl_loss=True, kl_loss_coef=0.1), on_rollout=reference_state,
                          progress=False)
    out["kl_records"], out["hf_dir"] = kl_seen, str(result.hf_checkpoint)

    train, held_out = arithmetic_rows(seed=0)
    data = Path(root) / "data"
    seen: list = []

    def observe(event):
        batch = event.gather_batch()
        seen.append({"metrics": dict(event.metrics), "num_groups": batch.num_groups,
                     "advantages": batch.advantages.copy(),
                     "group_ids": batch.group_ids.copy(),
                     "schedule_groups": [s.num_groups for s in event.schedule.steps]})

    run_training(_cfg(
        run_dir=f"{root}/math", num_rollout=3, rollout_batch_size=4, n_samples_per_prompt=4,
        global_batch_size=16, allow_partial_train_step=True, custom_rm_path=None,
        prompt_data=str(write_jsonl(data / "train.jsonl", train)), apply_chat_template=True,
        rm_type="math", rollout_max_response_len=1, rollout_shuffle=True,
        dynamic_sampling_filter_path="vime_shell.rollout.filters:nonzero_reward_std",
        over_sampling_batch_size=8, eval_interval=2, n_samples_per_eval_prompt=2,
        eval_prompt_data=("arith", str(write_jsonl(data / "eval.jsonl", held_out))),
        save=f"{root}/math-ck", save_interval=3), on_rollout=observe, progress=False)
    out["math"] = seen
    out["math_lines"] = (Path(root) / "math" / "metrics.jsonl").read_text().splitlines()
    out["loop_state"] = json.loads((Path(root) / "math-ck" / "rollout_000003" /
                                    "loop_state.json").read_text())
    return out


def broken_sync_worker(rank: int, root: str, cache: str) -> dict:
    """Rollout 0 trains, then the engine's weight update silently does nothing; rollout 1 was
    sampled with stale weights, so its one step must fail the gap check before updating."""
    os.environ["VIME_CACHE_DIR"] = cache
    from vime_shell.engines.hf import HfEngine
    from vime_shell.run.driver import run_training
    from vime_shell.train.weight_check import WeightSyncError

    HfEngine.update_weights_from_tensors = lambda self, named: [None for _ in named]
    seen: dict = {}

    def remember(event):
        seen["trainer"] = event.trainer
        seen["steps_after_rollout_0"] = event.trainer.steps_done

    try:
        run_training(_cfg(run_dir=f"{root}/broken", num_rollout=2, global_batch_size=16),
                     on_rollout=remember, progress=False)
    except WeightSyncError as exc:
        return {"error": str(exc), "steps_after_rollout_0": seen["steps_after_rollout_0"],
                "steps_done": seen["trainer"].steps_done}
    return {"error": None}


def _engine_1_down(ctx, what: str) -> None:
    """Rank 1's engine raises; rank 0's waits until it has (a key in the job's store, not a
    sleep), so engine 1 claims a chunk of the work queue at any load: engine 0 holds one chunk
    while it waits, and the queue has several. The wait is bounded, never a hang."""
    from datetime import timedelta

    import torch.distributed as dist

    from vime_shell.engines.work_queue import job_store

    down = f"tests/{what}/down"
    if dist.get_rank() == 1:
        job_store().set(down, "1")
        raise RuntimeError(f"{what} with prompts from {ctx.prompt_offset} is down")
    job_store().wait([down], timedelta(seconds=120))


def failing_share_rollout(ctx):
    """A rollout function whose second engine fails."""
    from vime_shell.rollout.functions import single_turn_rollout

    _engine_1_down(ctx, "engine")
    return single_turn_rollout(ctx)


def failing_eval_rollout(ctx):
    """Fails on the second engine during evaluation only (eval runs at temperature 0.5 here)."""
    from vime_shell.rollout.functions import single_turn_rollout

    if ctx.sampling.temperature == 0.5:
        _engine_1_down(ctx, "eval engine")
    return single_turn_rollout(ctx)


def quiet_rollout_log(rollout_id, args, samples, extra_metrics, rollout_time) -> bool:
    """A slime rollout-log hook that logs nothing (vime's own log still runs)."""
    return False


def engine_layouts_worker(rank: int, root: str, cache: str) -> dict:
    """The same dataset job (dynamic sampling rounds and an eval set) with two engines (one per
    rank, the default; its rollouts dumped), with one engine on rank 0, and with two engines and
    the whole batch on rank 0 (a rollout-log hook); then a run whose second engine fails."""
    os.environ["VIME_CACHE_DIR"] = cache
    from pathlib import Path

    from vime_shell.rollout.tasks import arithmetic_rows, write_jsonl
    from vime_shell.run.driver import run_training

    train, held_out = arithmetic_rows(seed=0)
    data = Path(root) / f"data-rank{rank}"  # each rank its own copy: no process group yet
    write_jsonl(data / "train.jsonl", train)
    write_jsonl(data / "eval.jsonl", held_out)
    job = dict(num_rollout=2, rollout_batch_size=4, n_samples_per_prompt=4, global_batch_size=16,
               allow_partial_train_step=True, custom_rm_path=None, rm_type="math",
               prompt_data=str(data / "train.jsonl"), apply_chat_template=True,
               rollout_max_response_len=1, over_sampling_batch_size=6,
               dynamic_sampling_filter_path="vime_shell.rollout.filters:nonzero_reward_std",
               eval_prompt_data=("held_out", str(data / "eval.jsonl")), eval_interval=1)
    out: dict = {}
    # "whole": a rollout-log hook (slime's, which receives the samples) keeps the whole batch
    # on rank 0, where rank 0 judges every group (the other two judge on the engines that
    # hold them: only verdicts travel). "two_engines" dumps its parts (--save-rollout-data).
    dumps = f"{root}/dumps/r{{rollout_id}}.npz"
    for name, extra in (("two_engines", {"save_rollout_data": dumps}),
                        ("one_engine", {"rollout_num_gpus": 1}),
                        ("whole", {"custom_rollout_log_function_path":
                                   "tests.shell.loop_workers:quiet_rollout_log"})):
        seen: list = []
        result = run_training(_cfg(run_dir=f"{root}/{name}", **job, **extra),
                              on_rollout=lambda e, seen=seen: seen.append({
                                  **(lambda b: {"tokens": np.asarray(b.tokens).copy(),
                                                "rewards": np.asarray(b.rewards).copy(),
                                                "advantages": np.asarray(b.advantages).copy(),
                                                "group_ids": b.original_group_ids()})(
                                      e.gather_batch()),
                                  "metrics": dict(e.metrics),
                                  "has_engine": e.engine is not None}),
                              progress=False)
        out[name] = {"rollouts": seen, "hf_dir": str(result.hf_checkpoint)}
    out["dumps"] = dumps
    failing = {"failure": dict(rollout_function_path="tests.shell.loop_workers:"
                               "failing_share_rollout"),
               # Two eval sets: the failure must reach every rank before the second set's
               # collective generation, or the healthy ranks would wait in it.
               "eval_failure": dict(job, eval_temperature=0.5, eval_prompt_data=(
                   "a", str(data / "eval.jsonl"), "b", str(data / "eval.jsonl")),
                   rollout_function_path="tests.shell.loop_workers:failing_eval_rollout")}
    for name, kwargs in failing.items():
        try:
            run_training(_cfg(**{"run_dir": f"{root}/{name}", **kwargs, "num_rollout": 1}),
                         progress=False)
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - the test reads which error each rank raised
            out[name] = (type(exc).__name__, str(exc))
    return out


_FILTER_CALLS = [0]


def rollout_one_filtered(samples) -> bool:
    """A dynamic-sampling filter passing rollout 0's 4 prompt groups, rejecting the 8 of
    rollout 1 (2 rounds of 4), and passing everything after: rollout 1 is fully filtered."""
    _FILTER_CALLS[0] += 1
    return not 4 < _FILTER_CALLS[0] <= 12


def filtered_rollout_worker(rank: int, root: str, cache: str) -> dict:
    """Three rollouts, the second fully filtered, a linear LR decay, a --save-hf template
    every 2 rollouts; stderr captured (not a terminal)."""
    import contextlib
    import io

    os.environ["VIME_CACHE_DIR"] = cache
    from vime_shell.run.driver import run_training

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        result = run_training(_cfg(
            run_dir=f"{root}/run", num_rollout=3, global_batch_size=16, lr_decay_style="linear",
            dynamic_sampling_filter_path="tests.shell.loop_workers:rollout_one_filtered",
            dynamic_sampling_max_rounds=2, save_hf=f"{root}/hf/iter_{{rollout_id}}",
            save_hf_interval=2, save_hf_dtype="bfloat16"), progress=False)
    return {"records": result.records, "stderr": err.getvalue()}


def initial_weights_rollout(ctx):
    """The built-in rollout, every sample stamped with weight version 0 (the initial weights):
    truthful when the engine never receives a sync (``stale_engine_worker``)."""
    from vime_shell.rollout.functions import single_turn_rollout

    out = single_turn_rollout(ctx)
    for prompt in out:
        for sample in prompt:
            sample.weight_versions = [0]
    return out


def current_version_rollout(ctx):
    """The built-in rollout stamped with the trainer's version: in the synchronous loop every
    rollout trains and syncs once, so rollout ``k`` samples with version ``k``."""
    from vime_shell.rollout.functions import single_turn_rollout

    out = single_turn_rollout(ctx)
    for prompt in out:
        for sample in prompt:
            sample.weight_versions = [ctx.rollout_id]
    return out


def stale_engine_worker(rank: int, root: str, cache: str) -> dict:
    """First two healthy runs with --use-tis: unstamped samples, and samples stamped with the
    current version. Then the engine keeps the initial weights (its weight update does
    nothing) and says so: its samples are stamped version 0 while the trainer moves on, with
    --use-tis; records per rollout."""
    os.environ["VIME_CACHE_DIR"] = cache
    from vime_shell.engines.hf import HfEngine
    from vime_shell.run.driver import run_training

    runs = {}
    stale = dict(num_rollout=3, global_batch_size=16, use_tis=True)
    for name, path in (("plain", None),
                       ("current", "tests.shell.loop_workers:current_version_rollout")):
        seen: list = []
        run_training(_cfg(run_dir=f"{root}/{name}", **stale, **(
            {"rollout_function_path": path} if path else {})),
            on_rollout=lambda e, seen=seen: seen.append(dict(e.metrics)), progress=False)
        runs[name] = seen
    HfEngine.update_weights_from_tensors = lambda self, named: [None for _ in named]
    stale["rollout_function_path"] = "tests.shell.loop_workers:initial_weights_rollout"
    seen: list = []
    run_training(_cfg(run_dir=f"{root}/tis", **stale),
                 on_rollout=lambda e: seen.append(dict(e.metrics)), progress=False)
    runs["tis"] = seen
    return runs


RS_BAND = (0.8, 1.25)


def stale_engine_rs_worker(rank: int, root: str, cache: str) -> dict:
    """The stuck engine of ``stale_engine_worker`` at DP=2 with --use-tis --use-rs (token
    level, band ``RS_BAND``, surviving denominator). Each rank checks its records: a token's
    mask is its loss mask times "its own old / behaviour ratio lies in the band", i.e. the
    old log-probs this rank judges its share with are its own."""
    os.environ["VIME_CACHE_DIR"] = cache
    from vime_shell.engines.hf import HfEngine
    from vime_shell.run.driver import run_training

    HfEngine.update_weights_from_tensors = lambda self, named: [None for _ in named]
    lo, hi = np.log(RS_BAND[0]), np.log(RS_BAND[1])
    seen: list = []

    def check(event):
        wrong = tokens = 0
        batch = event.gather_batch()
        for mb in event.records.microbatches:
            d = mb.old_log_probs.astype(np.float64) - mb.rollout_log_probs.astype(np.float64)
            want = batch.loss_masks[mb.response_index] * ((d >= lo) & (d <= hi))
            wrong += int((mb.loss_mask != want).sum())
            tokens += len(d)
        seen.append({**event.metrics, "wrong_masks": wrong, "scored": tokens})

    run_training(_cfg(run_dir=f"{root}/rs", num_rollout=3, global_batch_size=16, use_tis=True,
                      rollout_function_path="tests.shell.loop_workers:initial_weights_rollout",
                      use_rs=True, rs_level="token", rs_lower_bound=RS_BAND[0],
                      rs_upper_bound=RS_BAND[1], rs_denominator="surviving"),
                 on_rollout=check, progress=False)
    return {"rs": seen}


MIS_BAND = (0.5, 2.0)  # slime's mis.yaml: truncate at 2, reject outside [0.5, 2]


def stale_engine_mis_worker(rank: int, root: str, cache: str) -> dict:
    """The stuck engine of ``stale_engine_worker`` at DP=2 with slime's mis.yaml settings
    (``--tis-function mis``: token weights truncated at 2, batch-normalized per step; token
    rejection outside ``MIS_BAND``, the veto). Each rank checks its records: every weight is
    ``min(old / behaviour, 2)`` over one factor (the step's mean, summed over both ranks),
    and every mask its loss mask times "the ratio lies in the band"."""
    os.environ["VIME_CACHE_DIR"] = cache
    from vime_shell.engines.hf import HfEngine
    from vime_shell.run.driver import run_training

    HfEngine.update_weights_from_tensors = lambda self, named: [None for _ in named]
    lo, hi = np.log(MIS_BAND[0]), np.log(MIS_BAND[1])
    seen: list = []

    def check(event):
        batch = event.gather_batch()
        factors, wrong = [], 0
        for mb in event.records.microbatches:
            d = mb.old_log_probs.astype(np.float64) - mb.rollout_log_probs.astype(np.float64)
            mask = batch.loss_masks[mb.response_index]
            truncated = np.minimum(np.exp(d), MIS_BAND[1])
            factors.extend((truncated / mb.is_weights)[mask > 0].tolist())
            wrong += int((mb.loss_mask != mask * ((d >= lo) & (d <= hi))).sum())
        seen.append({**event.metrics, "factor_min": min(factors), "factor_max": max(factors),
                     "wrong_masks": wrong})

    run_training(_cfg(run_dir=f"{root}/mis", num_rollout=3, global_batch_size=16, use_tis=True,
                      rollout_function_path="tests.shell.loop_workers:initial_weights_rollout",
                      tis_function="mis", tis_level="token", tis_mode="truncate",
                      tis_lower_bound=MIS_BAND[0], tis_upper_bound=MIS_BAND[1],
                      tis_batch_normalize=True, use_rs=True, rs_level="token",
                      rs_veto_threshold=1e-4), on_rollout=check, progress=False)
    watched: list = []  # --get-mismatch-metrics alone: the metrics, no weights

    def unweighted(event):
        weights = [mb.is_weights for mb in event.records.microbatches]
        watched.append({**event.metrics, "weighted": any(w is not None for w in weights)})

    run_training(_cfg(run_dir=f"{root}/watch", num_rollout=2, global_batch_size=16,
                      rollout_function_path="tests.shell.loop_workers:initial_weights_rollout",
                      tis_function="mis", get_mismatch_metrics=True),
                 on_rollout=unweighted, progress=False)
    return {"mis": seen, "watch": watched}
