"""What a run prints: the per-rollout line, the end-of-run summary and the launch warnings
(a skipped rollout's record is ``vime_shell.train.records.skipped_record``). Pure formatting
of the records ``metrics.jsonl`` holds.

Example: ``rollout_line({"rollout": 12, "reward_mean": 0.312, ...})`` gives
``rollout   12  reward 0.312  loss -0.0004  entropy 2.310  gap 1.2e-07 ...``.
"""

from vime_pure.lr_schedule import lr_schedule_warnings
from vime_shell.run.run_log import fmt
from vime_shell.settings.train_config import TrainConfig


def shows_line(record: dict, k: int, count: int, interval: int, bar: bool) -> bool:
    """Whether rollout ``k`` of this run prints its line: on a terminal (a progress bar)
    evals, skipped rollouts and dynamic-sampling filtering stay visible above the bar;
    otherwise every ``--log-interval`` rollouts, the last one, evals and skipped rollouts."""
    notable = "eval_s" in record or bool(record.get("skipped"))
    if bar:
        return notable or bool(record.get("prompts_filtered"))
    return notable or k % interval == 0 or k + 1 == count


def run_summary(records: list[dict], seconds: float) -> str:
    """The end-of-run line: rollouts, reward first -> last (mean of the last 10 trained),
    skipped rollouts, optimizer steps and the wall time."""
    trained = [r for r in records if not r.get("skipped")]
    if not trained:
        return f"done: {len(records)} rollouts, all skipped (nothing passed the filter)"
    tail = trained[-10:]
    last10 = sum(r["reward_mean"] for r in tail) / len(tail)
    skipped = len(records) - len(trained)
    return (f"done: {len(records)} rollouts in {seconds:.0f} s, reward "
            f"{trained[0]['reward_mean']:.3f} -> {trained[-1]['reward_mean']:.3f} (last "
            f"{len(tail)}: {last10:.3f}), {sum(r['num_steps'] for r in trained)} optimizer "
            f"steps" + (f", {skipped} skipped" if skipped else ""))


def launch_warnings(cfg: TrainConfig, num_rollout: int) -> list[str]:
    """Settings that run but likely not as meant (logged once at launch)."""
    out = lr_schedule_warnings(style=cfg.lr_decay_style, lr=cfg.lr, min_lr=cfg.min_lr,
                               schedule=cfg.lr_schedule(num_rollout), num_rollout=num_rollout)
    if cfg.use_dynamic_global_batch_size:
        unused = (f"; --global-batch-size {cfg.global_batch_size} is unused, as in miles"
                  if cfg.global_batch_size is not None else "")
        out.append("--use-dynamic-global-batch-size: one optimizer step per rollout, of all the "
                   "groups it kept (--num-steps-per-rollout 1 with --allow-partial-train-step)"
                   + unused)
    elif cfg.partial_by_dynamic_sampling and not cfg.allow_partial_train_step:
        out.append("dynamic sampling may keep fewer than --rollout-batch-size "
                   f"{cfg.rollout_batch_size} prompts per rollout: the last optimizer step of "
                   "such a rollout is a partial one (--allow-partial-train-step is implied; "
                   "--dynamic-sampling-fill-filtered keeps batches full instead)")
    return out


def rollout_line(r: dict) -> str:
    """One rollout's progress line. Example: ``rollout   12  reward 0.312  loss -0.0004
    entropy 2.310  gap 1.2e-07  resp 2.0 (trunc 0.00)  mb/rank 1  1830 tok/s``."""
    if r.get("skipped"):
        line = (f"rollout {r['rollout']:4d}  skipped: all {r.get('prompts_generated', 0)} "
                f"prompts filtered out (reward {fmt(r['reward_mean'], '.3f')})")
    else:
        line = (f"rollout {r['rollout']:4d}  reward {r['reward_mean']:.3f}  "
                f"loss {fmt(r['loss'], '+.4f')}  entropy {fmt(r.get('entropy'), '.3f')}  "
                f"gap {fmt(r['logprob_gap'], '.1e')}  resp "
                f"{fmt(r.get('response_len_mean'), '.1f')} (trunc "
                f"{fmt(r.get('truncated_frac'), '.2f')})  mb/rank {r['num_microbatches']}  "
                f"{r.get('tokens_per_s', 0):.0f} tok/s")
    if r.get("prompts_generated", 0) != r.get("prompts_kept", 0) and not r.get("skipped"):
        line += f"  kept {r['prompts_kept']}/{r['prompts_generated']}"
    if r.get("probe_gap") is not None:  # separate engine ranks, stale batches
        line += f"  probe {r['probe_gap']:.1e}  stale {r.get('staleness_max', 0):.0f}"
    evals = eval_summary(r)
    return line + (f"  eval {evals}" if evals else "")


def eval_summary(r: dict) -> str:
    return ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in r.items()
                     if k.endswith("/reward_mean") and k.startswith("eval/"))
