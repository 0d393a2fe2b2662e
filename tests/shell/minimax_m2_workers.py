"""MiniMax-M2 runs in one 2-process gloo spawn (``tests/shell/test_minimax_m2.py``): a tiny
MiniMax-M2 (``TinyModelSpec(arch="minimax_m2")``) checked against transformers and trained on
the two synthetic rollouts of ``megatron_workers`` at DP2 and EP2; its q/k norm split over TP2
against the same norm whole; then converted at world size 1.
"""

from tests.shell.megatron_workers import conversion_only
from tests.shell.model_workers import train_run

LAYOUTS = {"dp2": {}, "ep2": {"ep": 2}}  # MoE under TP needs SP: TransformerEngine


def minimax_m2_worker(rank: int, hf_dir: str) -> dict:
    import warnings

    import torch.distributed as dist

    from vime_shell.megatron.platform import detect_platform

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    detect_platform()
    dist.init_process_group("gloo")
    out = {name: train_run(hf_dir, with_parity=True, **layout)
           for name, layout in LAYOUTS.items()}
    out["norm_tp2"] = split_norm_run()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        out["conversion"] = conversion_only(hf_dir)
        dist.destroy_process_group()
    return out


def split_norm_run() -> dict:
    """The all-heads q norm at TP2 (each rank two of four heads and their weight) against the
    same norm at TP1 on all heads: outputs, input and weight gradients."""
    import dataclasses

    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.transformer_config import TransformerConfig

    from vime_shell.megatron.minimax_m2_bridge import AllHeadsQNorm

    mpu.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = mpu.get_tensor_model_parallel_rank()
    base = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                             use_cpu_initialization=True)
    torch.manual_seed(0)
    whole = AllHeadsQNorm(base, 16)
    split = AllHeadsQNorm(dataclasses.replace(base, tensor_model_parallel_size=2), 16)
    with torch.no_grad():
        whole.weight.uniform_(0.5, 1.5)
        split.weight.copy_(whole.weight.view(4, 16)[2 * rank:2 * rank + 2].flatten())
    x = torch.randn(5, 2, 4, 16)
    weights = torch.randn(5, 2, 4, 16)
    x_whole, x_split = x.clone().requires_grad_(), x[:, :, 2 * rank:2 * rank + 2].clone()
    x_split.requires_grad_()
    heads = slice(2 * rank, 2 * rank + 2)
    with unittest_mock_tp1():
        out_whole = whole(x_whole)
    out_split = split(x_split)
    (out_whole * weights).sum().backward()
    (out_split * weights[:, :, heads]).sum().backward()
    out = {"output_max": float((out_split - out_whole[:, :, heads]).abs().max()),
           "input_grad_max": float((x_split.grad - x_whole.grad[:, :, heads]).abs().max()),
           "weight_grad_max": float((split.weight.grad - whole.weight.grad.view(4, 16)[heads]
                                     .flatten()).abs().max())}
    mpu.destroy_model_parallel()
    return out


def unittest_mock_tp1():
    """The whole norm computes alone, as on one rank."""
    from unittest import mock

    from megatron.core import parallel_state as mpu

    return mock.patch.object(mpu, "get_tensor_model_parallel_world_size", return_value=1)
