"""The bridge's weight path in a 2-rank job (rank 0: trainer, rank 1: engine), one body for
every backend: ``tests/shell/test_bridge.py`` runs it on gloo (CPU), ``tests/gpu/
test_bridge_gpu.py`` on NCCL (2 GPUs). Only the ``backend`` argument of ``open_sides``
differs; the command and weight code is the same.
"""

import torch
import torch.distributed as dist

from vime_shell.engines.remote import open_sides
from vime_shell.engines.roles import RankRoles

CAP = 64  # bytes per bucket: several buckets, one decoder layer never split


def sent_weights() -> list[tuple[str, torch.Tensor]]:
    """HF-named tensors of mixed dtypes and odd sizes (a bf16 tensor of 3 elements ahead of
    a float32 one: the receiving side must still view the latter aligned)."""
    g = torch.Generator().manual_seed(0)
    return [("model.embed_tokens.weight", torch.randn(5, 4, generator=g)),
            ("model.layers.0.input_layernorm.weight", torch.randn(3, generator=g).bfloat16()),
            ("model.layers.0.self_attn.q_proj.weight", torch.randn(4, 4, generator=g)),
            ("model.layers.1.mlp.gate_proj.weight", torch.randn(7, generator=g).half()),
            ("model.layers.1.mlp.e_score_correction_bias", torch.randn(3, generator=g)),
            ("model.norm.steps", torch.arange(5, dtype=torch.int64))]


def bridge_worker(rank: int, backend: str) -> dict:
    """Trainer: one ``("weights", 7)`` command, then every bucket; engine: receive them.
    Returns what this side saw (the engine's tensors on CPU, with the device they came on)."""
    sides = open_sides(RankRoles(world_size=2, num_trainers=1), backend=backend)
    bridge = sides.bridge
    if sides.is_trainer:
        bridge.command(("weights", 7))
        report = bridge.send_weights(((n, t.to(bridge.device)) for n, t in sent_weights()),
                                     CAP)
        out = {"buckets": report.buckets, "tensors": report.tensors,
               "reply": bridge.recv(src=1), "batch": bridge.recv(src=1)[1], "weight_bytes": report.bytes}
    else:
        command = bridge.command()
        got = [(n, t.device.type, t.cpu().clone()) for n, t in bridge.receive_weights()]
        bridge.send(("loaded", len(got)), dst=0)
        bridge.send(("batch", bytes(1000)), dst=0)
        out = {"command": command, "received": got}
    out["bytes"] = bridge.bytes.take().as_dict()
    dist.destroy_process_group()
    return out
