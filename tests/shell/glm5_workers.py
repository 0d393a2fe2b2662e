"""GLM-5 runs in one 2-process gloo spawn (``tests/shell/test_glm5.py``): a tiny GLM-5
(``TinyModelSpec(arch="glm_moe_dsa")``: sparse attention picking 4 keys per query, its indexer
on layers 1 and 3 and their selection reused by layers 2 and 4) checked against transformers
and trained on the two synthetic rollouts of ``megatron_workers`` at DP2, EP2, PP2 (each stage
starting on a full indexer layer) and DP2 with full recompute; then the sparse core attention
alone under context parallelism (THD, zigzag chunks) and sequence parallelism (TP2) against
the same layer on one rank; then the export round trip at world size 1.

Which of several keys with equal index scores transformers' indexer keeps is unspecified
(``torch.topk``; it depends on the row's layout); vime keeps the earlier one
(``sparse_attention.top_keys``). The workers run both with that rule (:func:`stable_topk`
in place of ``torch.Tensor.topk``, process-wide, so the routers of both models use it too):
without it 6 of 20 random packed rows of the tiny model differed from transformers by up to
0.18 in a logit, each through a tie.
"""

import torch


from tests.shell.megatron_workers import conversion_only
from tests.shell.model_workers import train_run

GLM5_LAYOUTS = {"dp2": {}, "ep2": {"ep": 2}, "pp2": {"pp": 2}}
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform",
             "recompute_num_layers": 1}


def stable_topk(self, k, dim=-1, largest=True, sorted=True):
    """``torch.Tensor.topk`` keeping the earlier of equal values (the rule of
    ``sparse_attention.top_keys``)."""
    values, index = self.sort(dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), index.narrow(dim, 0, k)))


def glm5_worker(rank: int, dirs: dict[str, str]) -> dict:
    import warnings

    import torch.distributed as dist

    from vime_shell.megatron.platform import detect_platform

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    torch.Tensor.topk = stable_topk  # the reference's ties as vime breaks them (docstring)
    detect_platform()
    dist.init_process_group("gloo")
    out = {name: train_run(dirs["glm5"], with_parity=True, **layout)
           for name, layout in GLM5_LAYOUTS.items()}
    out["recompute"] = train_run(dirs["glm5"], options=RECOMPUTE)
    out["split"] = {name: split_layer_run(dirs["glm5"], **kw) for name, kw in
                    (("cp", {"cp": 2}), ("sp", {"tp": 2, "sequence_parallel": True}))}
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        out["conversion"] = {name: conversion_only(path, native=True)
                             for name, path in dirs.items()}
        dist.destroy_process_group()
    return out


def split_layer_run(hf_dir: str, tp: int = 1, cp: int = 1,
                    sequence_parallel: bool = False) -> dict:
    """The sparse core attention of layer 1 on a THD row of three samples, split over two
    ranks by context parallelism (each rank's zigzag chunks) or by TP with sequence
    parallelism (each rank's heads; the indexer's inputs cut along the row), against the
    whole layer on each rank: the outputs and the query / key / value gradients."""
    import dataclasses
    from unittest import mock

    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.transformer_config import TransformerConfig

    from vime_pure.cp import zigzag_row_positions
    from vime_shell.megatron.sparse_attention import SelectionStore, SparseCoreAttention
    from vime_shell.megatron.tensors import thd_params
    from vime_shell.models.auto_config import auto_config

    hf = auto_config(hf_dir)
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    base = TransformerConfig(num_layers=1, hidden_size=hf.hidden_size, num_attention_heads=4,
                             use_cpu_initialization=True, tensor_model_parallel_size=tp,
                             context_parallel_size=cp)

    def layer(config):
        return SparseCoreAttention(config, 1, None, "self", softmax_scale=0.2, hf_config=hf,
                                   indexer_types=tuple(hf.indexer_types),
                                   store=SelectionStore(1))

    torch.manual_seed(0)
    whole = layer(base)
    split = layer(dataclasses.replace(base, sequence_parallel=sequence_parallel))
    split.load_state_dict(whole.state_dict())
    lengths = [8, 12, 4]  # multiples of 2 * cp
    total, heads = sum(lengths), 4
    qkv = [torch.randn(total, 1, heads, d) for d in (24, 24, 16)]
    x, qr = torch.randn(total, 1, hf.hidden_size), torch.randn(total, hf.q_lora_rank)
    params = thd_params(lengths)
    full = [t.clone().requires_grad_() for t in qkv]
    with mock.patch.object(mpu, "get_context_parallel_world_size", return_value=1):
        out_whole = whole(*full, None, x=x, qr=qr, packed_seq_params=params)
    if cp > 1:
        rows = torch.from_numpy(zigzag_row_positions(lengths, mpu.get_context_parallel_rank(),
                                                     cp))
        mine = [t[rows].clone().requires_grad_() for t in qkv]
        out_split = split(*mine, None, x=x[rows], qr=qr[rows], packed_seq_params=params)
        expected, heads_of = out_whole[rows], slice(None)
    else:
        rank = mpu.get_tensor_model_parallel_rank()
        heads_of = slice(rank * heads // tp, (rank + 1) * heads // tp)
        rows = torch.arange(rank * total // tp, (rank + 1) * total // tp)
        mine = [t[:, :, heads_of].clone().requires_grad_() for t in qkv]
        out_split = split(*mine, None, x=x[rows], qr=qr[rows], packed_seq_params=params)
        expected = out_whole.view(total, 1, heads, 16)[:, :, heads_of].reshape(total, 1, -1)
    weights = torch.randn_like(out_whole)
    (out_whole * weights).sum().backward()
    local_weights = weights[rows] if cp > 1 else \
        weights.view(total, 1, heads, 16)[:, :, heads_of].reshape(total, 1, -1)
    (out_split * local_weights).sum().backward()
    grads = [(a.grad[rows] if cp > 1 else a.grad[:, :, heads_of]) - b.grad
             for a, b in zip(full, mine)]
    out = {"output_max": float((out_split - expected).abs().max()),
           "grad_max": max(float(g.abs().max()) for g in grads),
           "indexer_frozen": not any(p.requires_grad for p in split.parameters())}
    mpu.destroy_model_parallel()
    return out
