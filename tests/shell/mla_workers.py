"""Multi-latent attention runs in one 2-process gloo spawn (``tests/shell/test_mla.py``): tiny
DeepSeek-V3 models (``TinyModelSpec(arch="deepseek_v3")``) converted, checked against
transformers and trained on the two synthetic rollouts of ``megatron_workers`` at DP2, EP2
and PP2; variants (no query low-rank with grouped routing, YaRN RoPE, all layers dense) at
DP2; TP2 is refused (``layout.check_mla_tensor_parallel``).
"""

from tests.shell.megatron_workers import conversion_only
from tests.shell.model_workers import train_run

MLA_LAYOUTS = {"dp2": {}, "ep2": {"ep": 2}, "pp2": {"pp": 2}}


def mla_worker(rank: int, dirs: dict[str, str]) -> dict:
    import warnings

    import torch.distributed as dist

    from vime_pure.errors import VimeError
    from vime_shell.megatron.platform import detect_platform

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    detect_platform()
    dist.init_process_group("gloo")
    out = {name: train_run(dirs["dsv3"], with_parity=True, **layout)
           for name, layout in MLA_LAYOUTS.items()}
    for variant in ("no_q_lora_groups", "yarn", "dense"):
        out[variant] = train_run(dirs[variant], with_parity=True)
    try:  # MLA under TP without sequence parallelism (layout.check_mla_tensor_parallel)
        train_run(dirs["dense"], tp=2)
    except VimeError as exc:
        out["tp2_error"] = str(exc)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:  # the export round trip at world size 1
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        out["conversion"] = {name: conversion_only(path) for name, path in dirs.items()}
        dist.destroy_process_group()
    return out
