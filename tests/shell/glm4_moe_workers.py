"""GLM-4.5 MoE runs in one 2-process gloo spawn (``tests/shell/test_glm4_moe.py``): tiny
GLM-4.5s (``TinyModelSpec(arch="glm4_moe")``) checked against transformers and trained on the
two synthetic rollouts of ``megatron_workers`` at DP2 and EP2; a GLM-4.5-Air-like variant
(no q/k norms, two expert groups) at DP2; then both converted at world size 1.
"""

from tests.shell.megatron_workers import conversion_only
from tests.shell.model_workers import train_run

GLM4_MOE_LAYOUTS = {"dp2": {}, "ep2": {"ep": 2}}  # MoE under TP needs SP: TransformerEngine


def glm4_moe_worker(rank: int, dirs: dict[str, str]) -> dict:
    import warnings

    import torch.distributed as dist

    from vime_shell.megatron.platform import detect_platform

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    detect_platform()
    dist.init_process_group("gloo")
    out = {name: train_run(dirs["glm45"], with_parity=True, **layout)
           for name, layout in GLM4_MOE_LAYOUTS.items()}
    out["air_groups"] = train_run(dirs["air_groups"], with_parity=True)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        out["conversion"] = {name: conversion_only(path, native=True)
                             for name, path in dirs.items()}
        dist.destroy_process_group()
    return out
