"""Process body for the checkpoint-safety test (importable, so ``spawn`` can run it).

It plants pickle payloads where a ``torch_dist`` loader looks and records what loading does.
A payload is a :class:`Planted`: unpickling it calls ``open(marker, "w")``, so code ran if and
only if the marker file exists afterwards.
"""

import shutil
from pathlib import Path


class Planted:
    """Pickles as ``open(marker, "w")``: unpickling it creates ``marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _outcome(trainer, checkpoint: Path, marker: Path) -> dict:
    """Load ``checkpoint`` into ``trainer``: the error it raised (type, message), if any, and
    whether the payload ran."""
    from vime_pure.errors import VimeError

    try:
        trainer.load_checkpoint(checkpoint)
        error = None
    except VimeError as exc:
        error = (type(exc).__name__, str(exc))
    return {"error": error, "ran": marker.exists()}


def planted_payloads_worker(rank: int, hf_dir: str, root: str) -> dict:
    """Save a checkpoint whose ``_extra_state`` of one layer is a payload; then load it, and
    copies of it with ``.metadata`` / ``common.pt`` replaced by payloads, into a fresh trainer.
    Last, the control: Megatron's stock loader on the same extra state runs the payload."""
    import pickle

    import torch
    from mbridge.core.util import unwrap_model
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from tests.shell.megatron_workers import ROLLOUT_SEEDS, rank_rollout
    from vime_pure import with_log_probs
    from vime_shell.megatron.trainer import MegatronTrainer, OptimConfig, TrainerConfig

    root_dir = Path(root)
    markers = {name: root_dir / f"ran-{name}" for name in ("extra_state", "metadata", "common")}
    config = TrainerConfig(optim=OptimConfig(lr=1e-4))
    trainer = MegatronTrainer.from_hf(hf_dir, config)
    _, _, mine = rank_rollout(128, ROLLOUT_SEEDS[0], trainer)
    old = trainer.compute_log_probs(mine.microbatches, mine.num_response_tokens)
    trainer.train(with_log_probs(mine, old_log_probs=old))  # so Adam has state to save
    layer = unwrap_model(trainer.model[0]).decoder.layers[0].mlp.linear_fc1
    layer.get_extra_state = lambda: Planted(str(markers["extra_state"]))
    checkpoint = root_dir / "ck"
    trainer.save_checkpoint(checkpoint)
    trainer.shutdown()

    for name, file in (("metadata", ".metadata"), ("common", "common.pt")):
        copy = root_dir / f"ck-{name}"
        shutil.copytree(checkpoint, copy)
        with open(copy / file, "wb") as fh:
            if name == "common":
                torch.save({"optimizer": Planted(str(markers[name]))}, fh)
            else:
                pickle.dump(Planted(str(markers[name])), fh)

    trainer = MegatronTrainer.from_hf(hf_dir, config)
    out = {name: _outcome(trainer, root_dir / f"ck-{name}", markers[name])
           for name in ("metadata", "common")}
    out["extra_state"] = _outcome(trainer, checkpoint, markers["extra_state"])
    objects, _ = extract_matching_values(unwrap_model(trainer.model[0]).sharded_state_dict(),
                                         lambda v: isinstance(v, ShardedObject))
    dist_checkpointing.load(objects, str(checkpoint))  # the stock path, for the control
    out["stock_loader_ran_it"] = markers["extra_state"].exists()
    trainer.shutdown()
    return out
