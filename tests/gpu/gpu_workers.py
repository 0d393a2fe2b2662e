"""Code the GPU tests run in spawned NCCL processes (module level, so it pickles)."""

import attrs
import numpy as np


def _init_nccl(rank: int) -> None:
    """Bind this rank's GPU, then create the NCCL group (``spawn`` set the torchrun env)."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group("nccl")


def _records(trainer, vocab: int, num_groups: int = 8):
    """This rank's records of a synthetic batch (one step of ``num_groups`` groups)."""
    from vime_pure import rank_batch
    from vime_shell.rollout.synthetic import synthetic_batch, synthetic_schedule

    batch = synthetic_batch(vocab, num_groups=num_groups, seed=21)
    schedule = synthetic_schedule(batch, trainer.layout, global_batch_size=num_groups)
    return rank_batch(batch, schedule, dp_rank=trainer.dp_rank, cp_rank=trainer.cp_rank,
                      cp_size=trainer.layout.cp)


def _log_probs(trainer, mine):
    return trainer.compute_log_probs(mine.microbatches, mine.num_response_tokens)


def thd_vs_mask_worker(rank: int, hf_dir: str) -> dict:
    """bf16 log-probs with TE + THD packing vs the local spec + block-diagonal mask packing."""
    import torch
    import torch.distributed as dist

    from vime_shell.megatron.platform import Platform, detect_platform
    from vime_shell.megatron.trainer import MegatronTrainer

    _init_nccl(rank)
    thd = detect_platform()
    out = {"thd_platform": attrs.asdict(thd, value_serializer=lambda i, a, v: str(v))}
    results = {}
    for name, platform in (("thd", thd), ("mask", Platform(
            kind="cuda", backend="nccl", dtype=torch.bfloat16, transformer_engine=False,
            packing="mask"))):
        trainer = MegatronTrainer.from_hf(hf_dir, platform=platform)
        mine = _records(trainer, trainer.bridge.hf_config.vocab_size)
        results[name] = _log_probs(trainer, mine)
        trainer.shutdown()
    scored = ~np.isnan(results["thd"])
    out["max_diff"] = float(np.max(np.abs(results["thd"] - results["mask"])[scored]))
    out["mean_logp"] = float(np.mean(results["thd"][scored]))
    dist.destroy_process_group()
    return out


def bf16_step_worker(rank: int, hf_dir: str, ep: int = 1) -> dict:
    """One bf16 training step on the detected CUDA platform: finite loss, weights move;
    ``ep``: the expert-parallel size of an MoE model (``final``: the weights after)."""
    import torch.distributed as dist

    from vime_shell.megatron.trainer import MegatronTrainer, OptimConfig, TrainerConfig

    _init_nccl(rank)
    trainer = MegatronTrainer.from_hf(hf_dir, TrainerConfig(optim=OptimConfig(lr=1e-3)), ep=ep)
    before = trainer.hf_state_dict()
    results = trainer.train(_records(trainer, trainer.bridge.hf_config.vocab_size))
    after = trainer.hf_state_dict()
    moved = max(float((after[k].float() - before[k].float()).abs().max()) for k in before)
    out = {"losses": [r.metrics["loss"] for r in results], "moved": moved,
           "dtype": str(next(iter(after.values())).dtype),
           "final": {k: v.float().cpu().numpy() for k, v in after.items()}}
    trainer.shutdown()
    dist.destroy_process_group()
    return out


def cp_worker(rank: int, hf_dir: str, cp: int) -> dict:
    """Log-probs, first-step loss and gradient norm with context parallelism ``cp``."""
    import torch.distributed as dist

    from vime_shell.megatron.trainer import MegatronTrainer, OptimConfig, TrainerConfig

    _init_nccl(rank)
    trainer = MegatronTrainer.from_hf(hf_dir, TrainerConfig(optim=OptimConfig(lr=1e-3)), cp=cp)
    mine = _records(trainer, trainer.bridge.hf_config.vocab_size)
    logps = _log_probs(trainer, mine)
    result = trainer.train_step(mine.steps[0])
    out = {"logps": logps, "loss": result.metrics["loss"], "grad_norm": result.grad_norm}
    trainer.shutdown()
    dist.destroy_process_group()
    return out


def e2e_worker(rank: int, out_path: str, num_rollout: int, sizes: dict,
               control_stale_sync: bool = False) -> dict:
    """``vime train`` end to end (``tests.gpu.e2e_train``); the loop creates its own group."""
    from tests.gpu.e2e_train import run_e2e

    return run_e2e(out_path, num_rollout=num_rollout, control_stale_sync=control_stale_sync,
                   **sizes)
