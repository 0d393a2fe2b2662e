"""Process bodies for the run-time input checks of ``vime train`` (issue 19): plugins that
return what the trainer must never see, or that try to end the run, and a batch whose
gradient is not finite. Each case is one short run in one process; the tests assert on the
plain observations returned.
"""

import contextlib
import io
import os

import numpy as np

from tests.shell.loop_workers import TINY, _cfg


def no_logprobs_rollout(ctx):
    """The built-in rollout, minus the engine's log-probs (a user function that forgot them)."""
    from vime_shell.rollout.functions import single_turn_rollout

    out = single_turn_rollout(ctx)
    for samples in out:
        for s in samples:
            s.rollout_log_probs = None
    return out


def out_of_vocab_rollout(ctx):
    """Writes token id 25 (the embedded model has 20 rows) into prompt 1's second sample."""
    from vime_shell.rollout.functions import single_turn_rollout

    out = single_turn_rollout(ctx)
    out[1][1].tokens[-1] = 25
    return out


def shifted_logprobs_rollout(ctx):
    """Log-probs that are not the engine's (off by 0.5 nats each)."""
    from vime_shell.rollout.functions import single_turn_rollout

    out = single_turn_rollout(ctx)
    for samples in out:
        for s in samples:
            s.rollout_log_probs = [x - 0.5 for x in s.rollout_log_probs]
    return out


def masked_rollout(ctx):
    """Every response token masked out: nothing is scored, so no mean exists."""
    from vime_shell.rollout.functions import single_turn_rollout

    out = single_turn_rollout(ctx)
    for samples in out:
        for s in samples:
            s.loss_mask = [0] * s.response_length
    return out


def exit_reward(sample) -> float:
    raise SystemExit(0)


def _error(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test asserts the type and message
        return type(exc).__name__, str(exc)
    return None


def bad_rollouts_worker(rank: int, root: str, cache: str) -> dict:
    """Each bad plugin in turn, through ``run_training`` (and the CLI for the exiting reward)."""
    os.environ["VIME_CACHE_DIR"] = cache
    from vime_shell.cli.main import main
    from vime_shell.run.driver import run_training

    here = "tests.shell.bad_input_workers"
    out: dict = {}
    seen: list = []

    def run(name: str, **kwargs):
        return run_training(_cfg(run_dir=f"{root}/{name}", num_rollout=1, **kwargs),
                            on_rollout=lambda e: seen.append(dict(e.metrics)), progress=False)

    for name in ("no_logprobs", "out_of_vocab", "shifted_logprobs"):
        out[name] = _error(lambda: run(name, rollout_function_path=f"{here}:{name}_rollout"))
    out["checked_rollouts"] = len(seen)
    run("unchecked", rollout_function_path=f"{here}:no_logprobs_rollout", logprob_check=False)
    run("masked", rollout_function_path=f"{here}:masked_rollout")
    out["unchecked"], out["masked"] = seen[-2:]
    err = io.StringIO()
    argv = ["train", "--num-rollout", "1", "--run-dir", f"{root}/exit", "--custom-rm-path",
            f"{here}:exit_reward", *[f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()
                                     if k != "custom_rm_path"]]
    with contextlib.redirect_stderr(err):
        out["exit_status"] = main(argv)
    out["exit_stderr"] = err.getvalue()
    return out


def nonfinite_grad_worker(rank: int, root: str, cache: str) -> dict:
    """A batch with advantages of 1e38 (the loss overflows fp32): the step stops before any
    weight changes, or is skipped and counted under ``skip_nonfinite_grad_steps``."""
    os.environ["VIME_CACHE_DIR"] = cache
    import attrs
    import torch

    from tests.shell.megatron_workers import rank_rollout
    from vime_shell.megatron.config import OptimConfig, TrainerConfig
    from vime_shell.megatron.trainer import MegatronTrainer, NonFiniteGradError
    from vime_shell.models.embedded import build_embedded

    trainer = MegatronTrainer.from_hf(build_embedded(), TrainerConfig(optim=OptimConfig(lr=1e-3)))

    def weights() -> np.ndarray:
        return torch.cat([p.detach().flatten() for c in trainer.model
                          for p in c.parameters()]).numpy().copy()

    _, _, mine = rank_rollout(20, seed=0, trainer=trainer)
    step = mine.steps[0]
    huge = attrs.evolve(step, microbatches=tuple(
        attrs.evolve(mb, advantages=np.full_like(mb.advantages, 1e38))
        for mb in step.microbatches))
    before = weights()
    out: dict = {}
    try:
        trainer.train_step(huge)
    except NonFiniteGradError as exc:
        out["error"] = str(exc)
    out["unchanged_after_error"] = bool(np.array_equal(before, weights()))
    trainer.config = attrs.evolve(trainer.config, optim=attrs.evolve(
        trainer.config.optim, skip_nonfinite_grad_steps=True))
    result = trainer.train_step(huge)
    out["skipped"], out["grad_norm"] = result.skipped, result.grad_norm
    out["unchanged_after_skip"] = bool(np.array_equal(before, weights()))
    out["next_step_finite"] = np.isfinite(trainer.train_step(step).grad_norm)
    out["changed_after_normal_step"] = not np.array_equal(before, weights())
    trainer.shutdown()
    return out
