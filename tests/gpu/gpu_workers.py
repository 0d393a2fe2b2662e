"""Code the GPU tests run in spawned NCCL processes (module level, so it pickles)."""

import attrs
import numpy as np


def _init_nccl(rank: int) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    _init_nccl(rank)


def _rows_and_plan(trainer, vocab: int, num_groups: int = 8):
    from vime_shell.synthetic import synthetic_rows, synthetic_schedule
    from vime_shell.trainer import RankPlan

    rows = synthetic_rows(vocab, num_groups=num_groups, seed=21)
    schedule = synthetic_schedule(rows, trainer.layout, global_batch_size=num_groups)
    mine = rows.select(schedule.partitions[trainer.dp_rank])
    return mine, RankPlan.from_schedule(schedule, trainer.dp_rank)


def thd_vs_mask_worker(rank: int, hf_dir: str) -> dict:
    """bf16 log-probs with TE + THD packing vs the local spec + block-diagonal mask packing."""
    import torch
    import torch.distributed as dist

    from vime_shell.platform import Platform, detect_platform
    from vime_shell.trainer import MegatronTrainer

    _init_nccl(rank)
    thd = detect_platform()
    out = {"thd_platform": attrs.asdict(thd, value_serializer=lambda i, a, v: str(v))}
    results = {}
    for name, platform in (("thd", thd), ("mask", Platform(
            kind="cuda", backend="nccl", dtype=torch.bfloat16, transformer_engine=False,
            packing="mask"))):
        trainer = MegatronTrainer.from_hf(hf_dir, platform=platform)
        rows, plan = _rows_and_plan(trainer, trainer.bridge.hf_config.vocab_size)
        results[name] = trainer.compute_log_probs(rows, plan)
        trainer.shutdown()
    out["max_diff"] = max(float(np.max(np.abs(a - b)))
                          for a, b in zip(results["thd"], results["mask"]))
    out["mean_logp"] = float(np.mean(np.concatenate(results["thd"])))
    dist.destroy_process_group()
    return out


def bf16_step_worker(rank: int, hf_dir: str) -> dict:
    """One bf16 training step on the detected CUDA platform: finite loss, weights move."""
    import torch.distributed as dist

    from vime_shell.trainer import MegatronTrainer, OptimConfig, TrainerConfig

    _init_nccl(rank)
    trainer = MegatronTrainer.from_hf(hf_dir, TrainerConfig(optim=OptimConfig(lr=1e-3)))
    before = trainer.hf_state_dict()
    rows, plan = _rows_and_plan(trainer, trainer.bridge.hf_config.vocab_size)
    results = trainer.train(rows, plan)
    after = trainer.hf_state_dict()
    moved = max(float((after[k].float() - before[k].float()).abs().max()) for k in before)
    out = {"losses": [r.metrics["loss"] for r in results], "moved": moved,
           "dtype": str(next(iter(after.values())).dtype)}
    trainer.shutdown()
    dist.destroy_process_group()
    return out


def cp_worker(rank: int, hf_dir: str, cp: int) -> dict:
    """Log-probs, first-step loss and gradient norm with context parallelism ``cp``."""
    import torch.distributed as dist

    from vime_shell.trainer import MegatronTrainer, OptimConfig, TrainerConfig

    _init_nccl(rank)
    trainer = MegatronTrainer.from_hf(hf_dir, TrainerConfig(optim=OptimConfig(lr=1e-3)), cp=cp)
    rows, plan = _rows_and_plan(trainer, trainer.bridge.hf_config.vocab_size)
    logps = trainer.compute_log_probs(rows, plan)
    result = trainer.train_step(rows, plan.steps[0])
    out = {"logps": logps, "loss": result.metrics["loss"], "grad_norm": result.grad_norm}
    trainer.shutdown()
    dist.destroy_process_group()
    return out
