"""Process body for the slime-plugin loop test: the embedded model trained through slime's
plugin signatures (async reward, ``filter(args, samples)``, a rollout log function), with
``--load X --save X`` starting fresh then resuming, and eval without ``--eval-interval``."""

import os

CALLS: dict = {"rm": 0, "filter": [], "log": [], "eval_fn": []}


async def async_rm(args, sample):
    """slime's ``async def rm(args, sample)``: partial credit for the first character."""
    CALLS["rm"] += 1
    return float(sample.response[:1] == sample.label[:1])


def keep_all(args, samples):
    """slime's filter signature; keeps every group (recording what it saw)."""
    CALLS["filter"].append((type(args).__name__, len(samples)))
    return True


def drop_all(args, samples):
    """A filter that removes every group: a rollout-only rollout with nothing to dump."""
    return False


def eval_rollout(ctx):
    """miles' ``--eval-function-path``: evaluation's own rollout function (here the default
    one, recording the rollout it evaluates at)."""
    from vime_shell.rollout.functions import single_turn_rollout

    CALLS["eval_fn"].append((ctx.rollout_id, len(ctx.prompts)))
    return single_turn_rollout(ctx)


def log_rollout(rollout_id, args, samples, metrics, seconds):
    CALLS["log"].append((rollout_id, len(samples), all(s.response is not None for s in samples),
                         "prompts_kept" in metrics, seconds >= 0))
    return True  # slime: skip the default log; vime still writes metrics.jsonl


def slime_plugins_worker(rank: int, root: str, cache: str) -> dict:
    os.environ["VIME_CACHE_DIR"] = cache
    import json
    from pathlib import Path

    from tests.shell.loop_workers import _cfg
    from vime_shell.rollout.tasks import arithmetic_rows, write_jsonl
    from vime_shell.run.driver import run_training

    me = "tests.shell.slime_plugin_workers"
    _, held_out = arithmetic_rows(seed=0)
    eval_path = str(write_jsonl(Path(root) / "eval.jsonl", held_out))
    ck = f"{root}/ck"
    common = dict(run_dir=f"{root}/run", load=ck, save=ck, save_interval=2,
                  custom_rm_path=f"{me}.async_rm",
                  dynamic_sampling_filter_path=f"{me}:keep_all",
                  custom_rollout_log_function_path=f"{me}:log_rollout",
                  eval_prompt_data=("arith", eval_path), n_samples_per_eval_prompt=1,
                  eval_max_response_len=2)
    def evals() -> list[int]:
        lines = (Path(root) / "run" / "metrics.jsonl").read_text().splitlines()
        return [r["rollout"] for r in map(json.loads, lines) if "eval/arith/reward_mean" in r]

    first = run_training(_cfg(num_rollout=2, **common), progress=False)
    first_evals = evals()
    # The resumed run evaluates through its own --eval-function-path; training does not.
    second = run_training(_cfg(num_rollout=3, eval_function_path=f"{me}:eval_rollout",
                               **common), progress=False)
    rollout_only = _rollout_only(root)
    return {"rollout_only": rollout_only, "calls": CALLS,
            "starts": (first.start_rollout, second.start_rollout),
            "rewards": [r["reward_mean"] for r in first.records + second.records],
            "evals": (first_evals, evals())}


def _rollout_only(root: str) -> dict:
    """--debug-rollout-only: dumps and records, while building a trainer would raise."""
    from pathlib import Path

    from tests.shell.loop_workers import _cfg
    from vime_shell.megatron import trainer
    from vime_shell.run.launch_checks import launch_checks, model_dir
    from vime_shell.run.rollout_only import run_rollouts_only
    from vime_shell.storage.dump import load_rollout_batch

    def no_trainer(*args, **kwargs):
        raise AssertionError("--debug-rollout-only built a trainer")

    trainer.MegatronTrainer.from_hf = no_trainer
    cfg = _cfg(run_dir=f"{root}/ro", num_rollout=2, debug_rollout_only=True,
               save_rollout_data=f"{root}/ro/d/r_{{rollout_id}}.npz")
    result = run_rollouts_only(cfg, launch_checks(cfg, model_dir(cfg)), progress=False)
    dumps = sorted(Path(root, "ro", "d").glob("*.npz"))
    # A rollout whose every group the filter removed is logged as skipped, and not dumped.
    dropped = _cfg(run_dir=f"{root}/rf", num_rollout=1, debug_rollout_only=True,
                   dynamic_sampling_filter_path="tests.shell.slime_plugin_workers:drop_all",
                   dynamic_sampling_max_rounds=1,
                   save_rollout_data=f"{root}/rf/d/r_{{rollout_id}}.npz")
    skipped = run_rollouts_only(dropped, launch_checks(dropped, model_dir(dropped)),
                                progress=False)
    return {"records": [r["num_groups"] for r in result.records],
            "dumps": [load_rollout_batch(p).num_groups for p in dumps],
            "skipped": [(r["skipped"], r["num_groups"]) for r in skipped.records],
            "skipped_dumps": len(list(Path(root, "rf", "d").glob("*.npz")))}
