"""Multi-latent attention runs in one 2-process gloo spawn (``tests/shell/test_mla.py``): tiny
DeepSeek-V3 models (``TinyModelSpec(arch="deepseek_v3")``) converted, checked against
transformers and trained on the two synthetic rollouts of ``megatron_workers`` at DP2, EP2
and PP2; variants (no query low-rank with grouped routing, YaRN RoPE, all layers dense, and
GLM-4.7-Flash's config of the model) at DP2; TP2 is refused (``layout.check_mla_tensor_parallel``).
"""

from tests.shell.megatron_workers import ROLLOUT_SEEDS, conversion_only, rank_rollout
from tests.shell.model_workers import train_run

MLA_LAYOUTS = {"dp2": {}, "ep2": {"ep": 2}, "pp2": {"pp": 2}}


def _train(trainer, seed: int) -> None:
    from vime_pure import with_log_probs

    _, _, mine = rank_rollout(trainer.bridge.hf_config.vocab_size, seed, trainer)
    old = trainer.compute_log_probs(mine.microbatches, mine.num_response_tokens)
    trainer.train(with_log_probs(mine, old_log_probs=old))


def resume_run(hf_dir: str, checkpoint: str, **layout) -> dict:
    """Rollout 1, a checkpoint, rollout 2; then a fresh trainer loads it and trains rollout 2
    again: both final exports (the expert bias among them)."""
    from vime_shell.megatron.trainer import MegatronTrainer

    finals = []
    for resumed in (False, True):
        trainer = MegatronTrainer.from_hf(hf_dir, **layout)
        if resumed:
            trainer.load_checkpoint(checkpoint)
        else:
            _train(trainer, ROLLOUT_SEEDS[0])
            trainer.save_checkpoint(checkpoint)
        _train(trainer, ROLLOUT_SEEDS[1])
        finals.append({k: v.numpy() for k, v in trainer.hf_state_dict().items()})
        trainer.shutdown()
    return {"straight": finals[0], "resumed": finals[1]}


def mla_worker(rank: int, dirs: dict[str, str], checkpoint: str) -> dict:
    import warnings

    import torch.distributed as dist

    from vime_pure.errors import VimeError
    from vime_shell.megatron.platform import detect_platform

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    detect_platform()
    dist.init_process_group("gloo")
    out = {name: train_run(dirs["dsv3"], with_parity=True, **layout)
           for name, layout in MLA_LAYOUTS.items()}
    for variant in ("no_q_lora_groups", "yarn", "dense", "glm47_flash"):
        out[variant] = train_run(dirs[variant], with_parity=True)
    try:  # MLA under TP without sequence parallelism (layout.check_mla_tensor_parallel)
        train_run(dirs["dense"], tp=2)
    except VimeError as exc:
        out["tp2_error"] = str(exc)
    out["resume_ep2"] = resume_run(dirs["dsv3"], checkpoint, ep=2)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:  # the export round trip at world size 1
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        out["conversion"] = {name: conversion_only(path, native=name == "glm47_flash")
                             for name, path in dirs.items()}
        dist.destroy_process_group()
    return out
