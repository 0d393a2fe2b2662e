"""Trainer checkpoints in Megatron's distributed format: saved with one layout, loaded into any.

Purpose: ``--save`` / ``--load`` for the RL loop. :func:`save_checkpoint` writes, under ``path``:

- ``__<rank>_0.distcp`` + ``.metadata`` + ``common.pt`` + ``metadata.json``: a
  ``megatron.core.dist_checkpointing`` checkpoint in the ``torch_dist`` format
  (:mod:`vime_shell.megatron.torch_dist`) of the model weights and the optimizer: Adam's
  ``exp_avg`` / ``exp_avg_sq`` (and, with the distributed optimizer, its fp32 main params) as
  ShardedTensors under global keys (``decoder.layers.mlp.linear_fc1.weight`` has global shape
  ``[num_layers, ...]``), Adam's step and param groups in ``common.pt``; under
  ``--optimizer muon`` each Muon weight's ``momentum_buffer`` likewise (Adam's state for the
  rest);
- ``trainer_state.json``: the step counter, the LR scheduler, the layout it was saved with and
  every rank's torch and Megatron RNG states (base64), as JSON.

What reshards (tested in ``tests/shell/test_checkpoint_resume.py``): weights, Adam moments,
Adam's step, the LR schedule and the step counter load into any TP / PP / VPP / DP layout;
the distributed optimizer's state is saved as Megatron's ``fully_reshardable`` (gathered on
DP rank 0 while saving, sliced per rank while loading), so it loads into the plain optimizer
too. Not resharded: the RNG states are restored only into the layout they were saved with
(they are per rank), else the fresh run's seeded states stay; TransformerEngine's
``_extra_state`` (FP8 scaling history; ``None`` on CPU) is not loaded, because it is stored
pickled. Refused with ``CheckpointError``: a switch between the plain and the distributed
optimizer (either way: their common state differs, and a plain fp32 checkpoint has no
``fp32_param`` entries), between Adam and Muon, another model (missing keys, other shapes).

Invariants: same-layout resume is bit-identical to the uninterrupted run; PP=2 -> DP=2 resume
equals it to float rounding; loading never unpickles code (``torch_dist`` module docstring).

Example: ``save_checkpoint(trainer, "ck/rollout_3")`` at PP=2 on 2 ranks writes
``__0_0.distcp``, ``__1_0.distcp``, ...; ``load_checkpoint(trainer, "ck/rollout_3")`` at DP=2
returns ``False`` (resharded: RNG states not restored).
"""

import base64
import json
from pathlib import Path

import attrs
import torch
import torch.distributed as dist
from mbridge.core.util import unwrap_model
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from torch.distributed.checkpoint.api import CheckpointException

from vime_pure.errors import VimeError, field_error
from vime_shell.megatron.collectives import rank0_result
from vime_shell.megatron.muon import Muon
from vime_shell.megatron.torch_dist import (EXTRA_STATE, SafeCommonLoad, SyncTorchDistSave,
                                            check_metadata, split_objects)
from vime_shell.storage.files import fsync_tree, write_atomic

TRAINER_STATE = "trainer_state.json"
FORMAT = "vime-megatron-torch_dist-1"
# Megatron's sharded_state_dict options: the distributed optimizer's one format whose entries
# are tensors in model space (``fully_sharded_model_space``, 0.16.1's default, raises
# "flattened_range is not supported"; ``dp_reshardable`` / ``dp_zero_gather_scatter`` store
# pickled ShardedObjects); no "chained_N." key prefix, so plain and distributed keys agree.
SHARDING = {"distrib_optim_sharding_type": "fully_reshardable",
            "chained_optim_avoid_prefix": True, "singleton_local_shards": False}


class CheckpointError(VimeError):
    """A trainer checkpoint that cannot be loaded into this trainer; the message says why."""


def _sub_optimizers(trainer) -> list:
    return list(getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]))


def _inner_optimizers(trainer) -> list:
    return [o.optimizer for o in _sub_optimizers(trainer)]


def _allocate_state(trainer) -> None:
    """torch Adam creates its state at its first step, and Megatron 0.16.1's
    ``DistributedOptimizer.state_dict()`` (the load request is built from it) asserts on an
    empty one: give a fresh optimizer zero moments and step 0 (Muon: a zero momentum buffer),
    all overwritten by the load."""
    for inner in _inner_optimizers(trainer):
        for group in inner.param_groups:
            for p in group["params"]:
                if inner.state[p]:
                    continue
                if isinstance(inner, Muon):
                    inner.state[p]["momentum_buffer"] = torch.zeros_like(p)
                else:
                    inner.state[p].update(exp_avg=torch.zeros_like(p),
                                          exp_avg_sq=torch.zeros_like(p),
                                          step=torch.tensor(0.0))


def _load_optimizer(trainer, loaded: dict) -> None:
    """``optimizer.load_state_dict`` with two Megatron 0.16.1 + torch Adam gaps closed.

    The distributed optimizer's ``fully_reshardable`` load copies into every key of each Adam
    state, ``step`` included, which the checkpoint keeps in the param groups (KeyError
    'step'): its parameter state is loaded with the steps set aside. And it gives every
    parameter the *same* step tensor, which torch Adam increments in place, once per
    parameter per step: each parameter gets its own copy.
    """
    subs = _sub_optimizers(trainer)
    parts = [loaded] if len(subs) == 1 else [v for _, v in sorted(loaded.items())]
    for opt, part in zip(subs, parts):
        param_state = part.pop("param_state", None)  # the distributed optimizer's tensors
        opt.load_state_dict(part)
        steps = {p: s.pop("step") for p, s in opt.optimizer.state.items() if "step" in s}
        if param_state is not None:
            opt.load_parameter_state_from_fully_reshardable(param_state)
        for p, step in steps.items():
            opt.optimizer.state[p]["step"] = step.clone()


def _sharded_state_dict(trainer, is_loading: bool) -> dict:
    model = [unwrap_model(chunk).sharded_state_dict(metadata=dict(SHARDING))
             for chunk in trainer.model]
    optimizer = trainer.optimizer.sharded_state_dict(model, is_loading=is_loading,
                                                     metadata=dict(SHARDING))
    return {"model": model, "optimizer": optimizer}


def _encode(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _decode(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def _rng_state() -> dict:
    return {"cpu": _encode(torch.get_rng_state()),
            "tracker": {k: _encode(v) for k, v in get_cuda_rng_tracker().get_states().items()}}


def save_checkpoint(trainer, path: str | Path) -> None:
    """Write the trainer's state under ``path`` (collective; ``path`` is created, and must be
    empty or absent: the caller stages it, see ``vime_shell.run.run_checkpoint``)."""
    out = Path(path)
    rank = dist.get_rank()
    if out.is_dir() and any(out.iterdir()):  # on every rank, before anything is written
        raise field_error(CheckpointError, "path", str(out), "is a non-empty directory",
                          "save into a new directory; vime never writes over files")
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(trainer, is_loading=False), str(out),
                            sharded_strategy=SyncTorchDistSave())
    rngs = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(_rng_state(), rngs, dst=0)

    def write_state() -> None:
        state = {"format": FORMAT, "layout": attrs.asdict(trainer.layout),
                 "distributed_optimizer": trainer.config.optim.use_distributed_optimizer,
                 "optimizer": trainer.config.optim.optimizer,
                 "steps_done": trainer.steps_done, "scheduler": trainer.scheduler.state_dict(),
                 "rng": rngs}
        write_atomic(out / TRAINER_STATE, json.dumps(state))
        fsync_tree(out)

    # A failure on rank 0 (a full disk) reaches every rank instead of leaving them in a barrier.
    rank0_result(f"writing {out / TRAINER_STATE}", write_state)


def read_state(path: Path) -> dict:
    """``path``'s trainer state: JSON only (no pickle), checked for the fields a load needs."""
    file = path / TRAINER_STATE
    try:
        state = json.loads(file.read_text())
        if state.get("format") != FORMAT:
            raise ValueError(f"format {state.get('format')!r}, expected {FORMAT!r}")
        missing = {"layout", "distributed_optimizer", "steps_done", "scheduler", "rng"} - set(state)
        if missing:
            raise KeyError(sorted(missing))
        return state
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise field_error(CheckpointError, "path", str(path),
                          f"has no readable {TRAINER_STATE} ({type(exc).__name__}: {exc})",
                          "pass a directory written by save_checkpoint") from None


def _check_optimizer(trainer, path: Path, state: dict) -> None:
    """The checkpoint's optimizer is this trainer's (a checkpoint written before Muon existed
    records none: Adam). Adam's moments and Muon's momentum do not convert."""
    saved, mine = state.get("optimizer", "adam"), trainer.config.optim.optimizer
    if saved != mine:
        raise field_error(CheckpointError, "optimizer", mine,
                          f"differs from the checkpoint's {saved} ({path}): Adam's moments and "
                          "Muon's momentum do not convert",
                          f"pass --optimizer {saved} to resume this checkpoint")


def _load_sharded(trainer, path: Path, state: dict) -> dict:
    _check_optimizer(trainer, path, state)
    distributed = trainer.config.optim.use_distributed_optimizer
    if state["distributed_optimizer"] != distributed:
        # The two keep different common state (param groups with the step vs a common step)
        # and, in fp32, the plain one stores no fp32 main params.
        raise field_error(CheckpointError, "use_distributed_optimizer", distributed,
                          f"differs from the checkpoint's {state['distributed_optimizer']} "
                          f"({path}): optimizer state does not convert between the plain and "
                          "the distributed optimizer",
                          ("pass --use-distributed-optimizer" if state["distributed_optimizer"]
                           else "drop --use-distributed-optimizer, --use-precision-aware-"
                           "optimizer and --overlap-param-gather (each turns it on)")
                          + " to resume with the optimizer it was saved with (TP, PP and DP "
                          "sizes may change)")
    _allocate_state(trainer)
    request, _ = split_objects(_sharded_state_dict(trainer, is_loading=True))
    try:
        return dist_checkpointing.load(request, str(path), common_strategy=SafeCommonLoad(),
                                       strict=StrictHandling.RAISE_UNEXPECTED)
    except CheckpointingException as exc:
        raise field_error(CheckpointError, "path", str(path),
                          f"does not match this trainer ({str(exc).splitlines()[0][:300]})",
                          "load a checkpoint of the same model") from None
    except (CheckpointException, OSError) as exc:  # torch's reader on a damaged shard
        raise field_error(CheckpointError, "path", str(path),
                          f"cannot be read ({type(exc).__name__}: "
                          f"{(str(exc) or '?').splitlines()[0][:300]})",
                          "restore the checkpoint from a copy, or resume from an earlier "
                          "one") from None


@torch.no_grad()  # parameters are restored in place
def load_checkpoint(trainer, path: str | Path) -> bool:
    """Restore :func:`save_checkpoint` output into ``trainer``, whatever layout wrote it
    (collective). Returns True when the RNG states were restored too (same layout)."""
    path = Path(path)
    state = read_state(path)
    check_metadata(path)
    loaded = _load_sharded(trainer, path, state)
    for chunk, weights in zip(trainer.model, loaded["model"]):
        missing, unexpected = unwrap_model(chunk).load_state_dict(weights, strict=False)
        wrong = [k for k in missing if not k.endswith(EXTRA_STATE)] + list(unexpected)
        if wrong:
            raise field_error(CheckpointError, "path", str(path),
                              f"lacks or adds model weights {wrong[:5]}",
                              "load a checkpoint of the same model")
    _load_optimizer(trainer, loaded["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.steps_done = int(state["steps_done"])
    same_layout = state["layout"] == attrs.asdict(trainer.layout)
    if same_layout:
        mine = state["rng"][dist.get_rank()]
        torch.set_rng_state(_decode(mine["cpu"]))
        get_cuda_rng_tracker().set_states({k: _decode(v) for k, v in mine["tracker"].items()})
    dist.barrier()
    return same_layout
