"""Qwen3.5 runs in one 2-process gloo spawn (``tests/shell/test_qwen3_5.py``): a tiny dense
Qwen3.5, a tiny Qwen3.5-MoE (``TinyModelSpec(arch="qwen3_5")`` / ``"qwen3_5_moe"``, written
multimodal as released) and a tiny Qwen3-Next (``"qwen3_next"``) checked against transformers
and trained on the two synthetic rollouts of ``megatron_workers`` (dense at DP2, TP2 and PP2;
the MoE models at DP2 and EP2), then
converted at world size 1, the MoE also from its experts fused as Qwen3.5-MoE's release
stores them; and the linear-attention layer alone under sequence and context parallelism
against the same layer on one rank.
"""

from pathlib import Path

from tests.shell.model_workers import train_run

QWEN3_5_LAYOUTS = {"dp2": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}
MOE_LAYOUTS = {"dp2": {}, "ep2": {"ep": 2}}


def fuse_experts(src: Path, dst: Path) -> Path:
    """A copy of checkpoint ``src`` whose experts are stored fused per layer
    (``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``), as
    Qwen3.5-MoE's release stores them (transformers 5 writes them one by one)."""
    import re
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    per = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    layers = sorted({m.group(1) for m in map(per.match, tensors) if m})
    for layer in layers:
        count = len({m.group(2) for m in map(per.match, tensors) if m and m.group(1) == layer})
        take = [{p: tensors.pop(f"{layer}.{e}.{p}_proj.weight") for p in ("gate", "up", "down")}
                for e in range(count)]
        tensors[f"{layer}.gate_up_proj"] = torch.stack([torch.cat([t["gate"], t["up"]])
                                                        for t in take])
        tensors[f"{layer}.down_proj"] = torch.stack([t["down"] for t in take])
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def qwen3_5_worker(rank: int, dirs: dict[str, str]) -> dict:
    import warnings

    import torch.distributed as dist

    from vime_shell.megatron.platform import detect_platform

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    detect_platform()
    dist.init_process_group("gloo")
    out = {name: train_run(dirs["dense"], with_parity=True, **layout)
           for name, layout in QWEN3_5_LAYOUTS.items()}
    for model in ("moe", "next"):
        out[model] = {name: train_run(dirs[model], with_parity=True, **layout)
                      for name, layout in MOE_LAYOUTS.items()}
    out["split"] = {name: split_layer_run(dirs["dense"], **kw) for name, kw in
                    (("sp", {"tp": 2, "sequence_parallel": True}), ("cp", {"cp": 2}))}
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        out["conversion"] = {name: conversion(dirs[name]) for name in ("dense", "moe", "next")}
        out["conversion"]["moe_fused"] = conversion(dirs["moe_fused"], dirs["moe"])
        dist.destroy_process_group()
    return out


def conversion(hf_dir: str, per_expert_dir: str | None = None) -> dict:
    """The HF round trip of the language model (the vision tower is not trained, loaded or
    exported) and logit parity with transformers' ``Qwen3_5ForCausalLM``; the export names
    experts one by one, so a fused checkpoint is compared with ``per_expert_dir``'s."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.shell.model_workers import _logit_diff
    from vime_shell.megatron.trainer import MegatronTrainer
    from vime_shell.models.auto_config import auto_config

    trainer = MegatronTrainer.from_hf(hf_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, config=auto_config(hf_dir),
                                                     dtype=torch.float32)
    original = load_file(f"{per_expert_dir or hf_dir}/model.safetensors")
    language = {k for k in original if not k.startswith("model.visual.")}
    exported = trainer.hf_state_dict()
    out = {"keys_equal": set(exported) == language, "visual": len(original) - len(language),
           "keys": len(exported),
           "roundtrip_max": max(float((exported[k] - original[k]).abs().max())
                                for k in language),
           "logit_max": _logit_diff(trainer, hf_model, hf_model.config.vocab_size),
           "hf_class": type(hf_model).__name__}
    trainer.shutdown()
    return out


def split_layer_run(hf_dir: str, tp: int = 1, cp: int = 1,
                    sequence_parallel: bool = False) -> dict:
    """One linear-attention layer on a THD row of three samples, split over two ranks by
    sequence parallelism (TP2) or context parallelism (CP2, zigzag chunks), against the same
    layer whole on each rank: the outputs and the input and weight gradients."""
    import dataclasses

    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.transformer_config import TransformerConfig

    from vime_pure.cp import zigzag_chunks
    from vime_shell.megatron.linear_attention import LinearAttention
    from vime_shell.megatron.qwen3_5_bridge import Qwen3_5
    from vime_shell.megatron.tensors import thd_params
    from vime_shell.models.auto_config import auto_config

    text = auto_config(hf_dir)
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    base = TransformerConfig(num_layers=1, hidden_size=text.hidden_size, num_attention_heads=4,
                             use_cpu_initialization=True, tensor_model_parallel_size=tp,
                             context_parallel_size=cp)
    torch.manual_seed(0)
    whole = LinearAttention(base, 1, hf_class=Qwen3_5.GDN_CLASS, hf_config=text)
    split = LinearAttention(dataclasses.replace(base, sequence_parallel=sequence_parallel), 1,
                            hf_class=Qwen3_5.GDN_CLASS, hf_config=text)
    split.load_state_dict(whole.state_dict())
    lengths = [8, 12, 4]  # multiples of 2 * cp
    x = torch.randn(sum(lengths), 1, text.hidden_size)
    params = thd_params(lengths)
    x_whole = x.clone().requires_grad_()
    rank = mpu.get_context_parallel_rank() if cp > 1 else mpu.get_tensor_model_parallel_rank()
    out_whole, _ = _whole(whole, x_whole, params)
    if cp > 1:
        starts = [0, 8, 20]
        local = torch.cat([torch.arange(s + a, s + e) for s, n in zip(starts, lengths)
                           for a, e in zigzag_chunks(n, rank, cp)])
    else:
        local = torch.arange(rank * x.shape[0] // tp, (rank + 1) * x.shape[0] // tp)
    x_split = x[local].clone().requires_grad_()
    out_split, _ = split(x_split, packed_seq_params=params)
    weights = torch.randn_like(out_whole)
    (out_whole * weights).sum().backward()
    (out_split * weights[local]).sum().backward()
    grads_whole = {n: p.grad for n, p in whole.named_parameters()}
    grads = {}
    for n, p in split.named_parameters():  # each rank's weight gradient covers its positions
        g = p.grad.clone()
        if cp > 1:
            torch.distributed.all_reduce(g, group=mpu.get_context_parallel_group())
        grads[n] = float((g - grads_whole[n]).abs().max())
    out = {"output_max": float((out_split - out_whole[local]).abs().max()),
           "input_grad_max": float((x_split.grad - x_whole.grad[local]).abs().max()),
           "weight_grad_max": max(grads.values())}
    mpu.destroy_model_parallel()
    return out


def _whole(layer, x, params):
    """``layer`` on the whole row at one rank's view: no SP, no CP."""
    from unittest import mock

    from megatron.core import parallel_state as mpu

    with mock.patch.object(mpu, "get_context_parallel_world_size", return_value=1):
        return layer(x, packed_seq_params=params)
