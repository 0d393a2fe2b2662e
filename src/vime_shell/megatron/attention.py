"""Softmax attention on Megatron's local spec, for the core attentions vime builds where
Megatron's ``DotProductAttention`` cannot serve: MLA's (value heads narrower than query
heads, ``mla_bridge``), gpt-oss's (sinks and a window inside packed samples,
``gpt_oss_bridge``) and GLM-5's sparse one (``sparse_attention``). Each decides which keys a
query may see; this computes the attention over them, in fp32.

Under context parallelism (THD, each rank holding two zigzag chunks of every sample, as the
records cut them) a layer that needs the whole row calls :func:`gather_zigzag`: gated
delta-net's recurrence (``linear_attention``) and the sparse attention's keys
(``sparse_attention``).

Example: ``softmax_attention(q, k, v, causal_mask(s)[None, None], 0.125)`` for queries ``[s, b,
h, d]`` is causal attention, ``[s, b, h * dv]``.
"""

import numpy as np
import torch
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from vime_pure.cp import zigzag_row_positions


def causal_mask(s: int, device=None) -> torch.Tensor:
    """``[s, s]`` bool, True where a query may not look (the future)."""
    return torch.ones(s, s, dtype=torch.bool, device=device).triu(1)


def softmax_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      blocked: torch.Tensor, softmax_scale: float,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Queries ``[sq, b, h, dk]`` over keys ``[sk, b, g, dk]`` and values ``[sk, b, g, dv]``
    (``g`` query groups, each repeated for ``h / g`` heads), ``blocked`` broadcastable to
    ``[b, h, sq, sk]`` (True = masked out). ``sinks`` ``[h]``: one more logit per head in
    every query's softmax, dropped after it (gpt-oss's). Returns ``[sq, b, h * dv]``."""
    heads, groups = query.shape[2], key.shape[2]
    if groups != heads:
        key, value = (t.repeat_interleave(heads // groups, dim=2) for t in (key, value))
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * softmax_scale
    scores = scores.masked_fill(blocked, float("-inf"))
    if sinks is not None:
        b, h, s, _ = scores.shape
        scores = torch.cat([scores, sinks.float().view(1, h, 1, 1).expand(b, h, s, 1)], -1)
        scores = scores - scores.max(dim=-1, keepdim=True).values  # as transformers does
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    out = torch.matmul(probs.to(v.dtype), v)  # [b, h, sq, dv]
    b, h, s, dv = out.shape
    return out.permute(2, 0, 1, 3).reshape(s, b, h * dv)


def gather_zigzag(x: torch.Tensor, lengths, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[s_local, ...]`` of every CP rank put back in row order (the backward sums each
    row's gradient over the ranks and keeps this rank's), and this rank's positions in the
    row (module docstring); ``lengths``: the samples of the packed row (THD ``cu_seqlens``)."""
    if lengths is None:
        raise NotImplementedError("context parallelism needs THD packing (cu_seqlens)")
    group = mpu.get_context_parallel_group()
    gathered = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True,
                                                    group=group)
    positions = [zigzag_row_positions(lengths, r, cp) for r in range(cp)]
    order = torch.from_numpy(np.argsort(np.concatenate(positions))).to(x.device)
    local = torch.from_numpy(positions[mpu.get_context_parallel_rank()]).to(x.device)
    return gathered.index_select(0, order), local
