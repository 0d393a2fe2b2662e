"""``--save-hf``: the trained weights as a Hugging Face checkpoint, streamed, one writer per
node, after every ``--save-hf-interval`` rollouts (a ``{rollout_id}`` template) or at the end.

Example: ``--save-hf out/hf_{rollout_id} --save-hf-interval 10`` over 20 rollouts writes
``out/hf_10`` and ``out/hf_20``; a plain ``--save-hf out/hf`` writes ``out/hf`` once, at the end.
"""

import itertools
from pathlib import Path

import torch
import torch.distributed as dist

from vime_shell.megatron.layout import ranks_per_node_from_env
from vime_shell.megatron.trainer import MegatronTrainer
from vime_shell.models.hf_config import read_config_summary
from vime_shell.settings.train_config import TrainConfig
from vime_shell.storage.hf_export import save_hf_checkpoint
from vime_shell.storage.sizes import parse_size
from vime_shell.storage.untrained import untrained_tensors


def saves_hf(cfg: TrainConfig, done: int, total: int) -> bool:
    """A ``{rollout_id}`` template writes every ``--save-hf-interval`` (default
    ``--save-interval``) rollouts and after the last; a plain path only at the end."""
    if not cfg.save_hf_is_template:
        return False
    interval = cfg.save_hf_interval or cfg.save_interval
    return done % interval == 0 or done == total


def save_hf(cfg: TrainConfig, trainer: MegatronTrainer, hf_dir: Path, template: str,
            rollouts_done: int) -> Path:
    """Collective: write the weights after ``rollouts_done`` rollouts to ``template``
    (``--save-hf``, its ``{rollout_id}`` filled in) with one writer per node; rank 0
    finalises the index.

    Streamed: the export comes in buckets of one shard's size (``trainer.hf_buckets``),
    each cast to the export dtype, and each writer keeps only its own shards, so a rank
    holds about one shard and one bucket of host memory, never the model; ranks without a
    writer drain the export. The checkpoint's tensors vime does not train (a vision tower,
    multi-token prediction layers: ``vime_shell.storage.untrained``) follow, as they are."""
    target = save_hf_path(template, rollouts_done)
    summary = read_config_summary(hf_dir)
    dtype = cfg.save_hf_dtype or summary.dtype
    limit = parse_size(cfg.save_hf_max_shard_size)
    trained = (pair for bucket in trainer.hf_buckets(limit)
               for pair in as_export_dtype(dict(bucket), dtype).items())
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = ranks_per_node_from_env() or world
    writers = list(range(0, world, per_node))
    group = dist.new_group(writers)
    try:
        if rank in writers:
            pairs = itertools.chain(trained, untrained_tensors(
                hf_dir, summary.num_layers, mtp_trained=cfg.enable_mtp_training))
            save_hf_checkpoint(pairs, source_dir=hf_dir, target_dir=target,
                               max_shard_size=limit, writer_rank=writers.index(rank),
                               writers=len(writers), barrier=lambda: dist.barrier(group=group),
                               overwrite=cfg.save_hf_overwrite)
    finally:
        for _ in trained:  # the export is collective: drained here too after a failure
            pass
    dist.barrier()
    return target


def as_export_dtype(tensors: dict[str, torch.Tensor], dtype: str | None
                    ) -> dict[str, torch.Tensor]:
    """Floating-point tensors cast to ``dtype`` (``--save-hf-dtype``, else the config's
    ``torch_dtype``): a bf16 model trained in fp32 on CPU exports bf16 as its config says.
    Integer tensors and ``dtype=None`` are left alone. Example: fp32 -> ``"bfloat16"``."""
    if dtype is None:
        return tensors
    target = getattr(torch, dtype, None)
    if not isinstance(target, torch.dtype) or not target.is_floating_point:
        return tensors  # an unknown name in a user's config.json: keep the trainer's dtype
    return {k: t.to(target) if t.is_floating_point() else t for k, t in tensors.items()}


def save_hf_path(template: str, rollouts_done: int) -> Path:
    """``--save-hf`` with ``{rollout_id}`` replaced by the rollouts trained so far.
    Example: ``save_hf_path("out/hf_{rollout_id}", 20) == Path("out/hf_20")``."""
    return Path(template.replace("{rollout_id}", str(rollouts_done))).expanduser()
