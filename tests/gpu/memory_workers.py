"""Code the GPU memory / MoE tests run in spawned NCCL processes (module level, so it pickles)."""

from tests.gpu.gpu_workers import _init_nccl, _records


def offload_worker(rank: int, hf_dir: str) -> dict:
    """``--offload-train``: CUDA bytes freed by ``offload()`` and the exactness of ``reload()``."""
    import torch
    import torch.distributed as dist

    from vime_shell.megatron.trainer import MegatronTrainer, OptimConfig, TrainerConfig

    _init_nccl(rank)
    trainer = MegatronTrainer.from_hf(hf_dir, TrainerConfig(optim=OptimConfig(lr=1e-3)))
    trainer.train(_records(trainer, trainer.bridge.hf_config.vocab_size))  # Adam state exists
    before = {k: v.clone() for k, v in trainer.hf_state_dict().items()}
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    report = trainer.offload()
    torch.cuda.synchronize()
    freed = allocated - torch.cuda.memory_allocated()
    trainer.reload()
    after = trainer.hf_state_dict()
    out = {"reported": report.bytes, "freed": freed,
           "roundtrip_max": max(float((after[k].float() - before[k].float()).abs().max())
                                for k in before),
           "losses": [r.metrics["loss"] for r in trainer.train(
               _records(trainer, trainer.bridge.hf_config.vocab_size))]}
    trainer.shutdown()
    dist.destroy_process_group()
    return out


def optimizer_offload_worker(rank: int, hf_dir: str, offload: bool, precision_aware: bool) -> dict:
    """One step with ``--optimizer-cpu-offload`` (and/or the precision-aware optimizer): the
    loss, how far the weights moved, and the CUDA bytes held after the step."""
    import torch
    import torch.distributed as dist

    from vime_shell.megatron.trainer import MegatronTrainer, OptimConfig, TrainerConfig

    _init_nccl(rank)
    optim = OptimConfig(lr=1e-3, optimizer_cpu_offload=offload,
                        overlap_cpu_optimizer_d2h_h2d=offload,
                        use_precision_aware_optimizer=precision_aware,
                        use_distributed_optimizer=precision_aware)
    trainer = MegatronTrainer.from_hf(hf_dir, TrainerConfig(optim=optim))
    before = trainer.hf_state_dict()
    results = trainer.train(_records(trainer, trainer.bridge.hf_config.vocab_size))
    torch.cuda.synchronize()
    after = trainer.hf_state_dict()
    out = {"losses": [r.metrics["loss"] for r in results],
           "moved": max(float((after[k].float() - before[k].float()).abs().max())
                        for k in before),
           "allocated": torch.cuda.memory_allocated()}
    trainer.shutdown()
    dist.destroy_process_group()
    return out

