"""GLM-4 runs in one 2-process gloo spawn (``tests/shell/test_glm4.py``): a tiny dense GLM-4
(``TinyModelSpec(arch="glm4")``) checked against transformers and trained on the two
synthetic rollouts of ``megatron_workers`` at DP2, TP2 and PP2, then converted at world size 1.
"""

from tests.shell.megatron_workers import conversion_only
from tests.shell.model_workers import train_run

GLM4_LAYOUTS = {"dp2": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}


def glm4_worker(rank: int, hf_dir: str) -> dict:
    import warnings

    import torch.distributed as dist

    from vime_shell.megatron.platform import detect_platform

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    detect_platform()
    dist.init_process_group("gloo")
    out = {name: train_run(hf_dir, with_parity=True, **layout)
           for name, layout in GLM4_LAYOUTS.items()}
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        out["conversion"] = conversion_only(hf_dir)
        dist.destroy_process_group()
    return out
