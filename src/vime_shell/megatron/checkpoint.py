"""Trainer checkpoints for resume: one file per rank, same layout on reload.

Purpose: ``--save`` / ``--load`` for the RL loop. Each global rank writes ``rankNNNNN.pt``
(temp file + rename, so a crash never leaves a half-written file under the final name) holding
its model chunks' state dicts, per sub-optimizer the inner torch optimizer state and its (main)
parameters, the LR scheduler, the trainer's step counter, the CPU RNG and Megatron's rng
tracker states.

Why the inner optimizer: Megatron's ``get_parameter_state_dp_zero`` round trip assumes fused
Adam and fails on torch Adam's per-parameter ``step``; with the layout fixed, each rank's shard
of the distributed optimizer *is* its inner optimizer, which this saves exactly.

Invariant (tested in ``tests/shell/test_checkpoint_resume.py``): a fresh trainer that loads a
checkpoint and trains the remaining rollouts ends bit-identical to the uninterrupted run, with
the plain and with the distributed optimizer.

Example: ``save_checkpoint(trainer, "ckpt/rollout_3")`` on 2 ranks writes ``rank00000.pt`` and
``rank00001.pt``; ``load_checkpoint(trainer, "ckpt/rollout_3")`` with another layout raises.
"""

from pathlib import Path

import attrs
import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from vime_pure.errors import VimeError, field_error
from vime_shell.storage.files import atomic_file


def _sub_optimizers(trainer) -> list:
    return list(getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]))


def _optimizer_state(trainer) -> list[dict]:
    return [{"inner": o.optimizer.state_dict(),
             "main": [p.detach().clone() for g in o.optimizer.param_groups for p in g["params"]]}
            for o in _sub_optimizers(trainer)]


def save_checkpoint(trainer, path: str | Path) -> None:
    """Write this rank's state under ``path`` (collective: ends with a barrier)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {"layout": attrs.asdict(trainer.layout), "steps_done": trainer.steps_done,
             "model": [c.state_dict() for c in trainer.model],
             "optimizer": _optimizer_state(trainer), "scheduler": trainer.scheduler.state_dict(),
             "rng": {"cpu": torch.get_rng_state(),
                     "tracker": get_cuda_rng_tracker().get_states()}}
    with atomic_file(out / f"rank{dist.get_rank():05d}.pt") as fh:
        torch.save(state, fh)
    dist.barrier()


class TrainerCheckpointError(VimeError):
    """A trainer state file that is not a checkpoint this code wrote (foreign, torn, tampered)."""


def read_state(file: Path) -> dict:
    """One rank's state with ``torch.load(weights_only=True)``: tensors and plain containers
    only, so a planted pickle is refused without running any of its code."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError (code in it), RuntimeError (torn zip), EOFError
        raise field_error(TrainerCheckpointError, "path", str(file),
                          f"is not a readable trainer checkpoint ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:120] if str(exc) else ''})",
                          "restore it from a copy, or resume from another checkpoint") from None
    if not isinstance(state, dict) or not {"layout", "model", "optimizer"} <= set(state):
        raise field_error(TrainerCheckpointError, "path", str(file),
                          "does not hold a trainer state", "point --load at a --save directory")
    return state


@torch.no_grad()  # parameters are restored in place
def load_checkpoint(trainer, path: str | Path) -> None:
    """Restore what :func:`save_checkpoint` wrote with the same layout (collective)."""
    file = Path(path) / f"rank{dist.get_rank():05d}.pt"
    if not file.is_file():
        raise field_error(VimeError, "path", str(path), f"has no {file.name}",
                          "pass a directory written by save_checkpoint with this world size")
    state = read_state(file)
    if state["layout"] != attrs.asdict(trainer.layout):
        raise field_error(VimeError, "layout", state["layout"],
                          f"differs from this run's {attrs.asdict(trainer.layout)}",
                          "resume with the parallel sizes the checkpoint was written with")
    for chunk, sd in zip(trainer.model, state["model"]):
        chunk.load_state_dict(sd, strict=True)
    for opt, saved in zip(_sub_optimizers(trainer), state["optimizer"]):
        opt.optimizer.load_state_dict(saved["inner"])
        params = [p for g in opt.optimizer.param_groups for p in g["params"]]
        for param, value in zip(params, saved["main"]):
            param.copy_(value)
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.steps_done = state["steps_done"]
    torch.set_rng_state(state["rng"]["cpu"])
    get_cuda_rng_tracker().set_states(state["rng"]["tracker"])
    dist.barrier()
