"""Gated delta-net (linear attention) layers inside Megatron's ``GPTModel``: Qwen3.5's and
Qwen3-Next's ``linear_attention`` layers (slime's ``--spec slime_plugins.models.qwen3_5``).

Megatron-core 0.16's own ``GatedDeltaNet`` (``megatron.core.ssm``) cannot serve here: it needs
fla's Triton kernels to build, refuses packed sequences, its spec builder is TransformerEngine
only, and its flat ``in_proj`` would need a per-TP-rank reordering of the HF weights. mbridge
0.15 maps neither family. So the layer's attention slot holds **transformers' own module**
(``Qwen3_5GatedDeltaNet``), named ``linear_attn`` as in the HF checkpoint: its weights map by
name, and its kernels are whatever transformers picks (fla when installed, else its pure-torch
chunked rule, which runs on CPU). :class:`LinearAttention` is that slot; it moves Megatron's
layout to the module's and back:

- ``[s, b, h]`` (Megatron) to ``[n, L, h]`` (HF): one row per **sample**. The samples of a
  packed row are cut apart (the recurrence must not carry state from one sample into the
  next): by ``cu_seqlens`` under THD, by the block-diagonal mask's breaks in vime's CPU
  ``mask`` layout (a position that may not see its predecessor starts a sample), one per row
  in the ``padded`` layout. Each sample starts its HF row and pads follow it; the rule is
  causal, so pads never reach a sample's outputs.
- Sequence parallelism: the input is gathered over TP (backward: this rank's slice of the
  gradient, which is already whole, since every rank computes the full output) and this
  rank's slice of the output is kept. The weights are replicated over TP, as slime's are.
- Context parallelism (THD): each rank holds two zigzag chunks of every sample
  (``vime_pure.cp.zigzag_row_positions``, as the records cut them); the chunks are gathered
  over CP and put back in order, the samples run whole, and this rank keeps its chunks. The
  backward sums the gradient of each input position over the CP ranks (reduce-scatter).

Example: ``linear_attention_spec(text_config)`` is the ``self_attention`` spec of a Qwen3.5
linear-attention layer; the layer's output equals transformers' (``tests/shell/test_qwen3_5.py``).
"""

import numpy as np
import torch
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.mappings import (gather_from_sequence_parallel_region,
                                                    scatter_to_sequence_parallel_region)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from vime_shell.megatron.attention import gather_zigzag


class LinearAttention(MegatronModule):
    """Megatron's ``self_attention`` slot holding transformers' gated delta-net (module
    docstring); returns ``(output, None)`` as Megatron's attention does (no separate bias)."""

    def __init__(self, config, layer_number: int, *, hf_class: type, hf_config, **_):
        super().__init__(config=config)
        # named as in the checkpoint: model.layers.{n}.linear_attn.*
        self.linear_attn = hf_class(hf_config, layer_number - 1).to(config.params_dtype)

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **_):
        x = hidden_states
        if self.config.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        cp = mpu.get_context_parallel_world_size()
        lengths = None if packed_seq_params is None else \
            torch.diff(packed_seq_params.cu_seqlens_q).tolist()
        if cp > 1:
            x, local = gather_zigzag(x, lengths, cp)
        out = self._per_sample(x, _sample_bounds(x.shape, attention_mask, lengths))
        if cp > 1:
            out = out.index_select(0, local)
        if self.config.sequence_parallel:
            out = scatter_to_sequence_parallel_region(out)
        return out, None

    def _per_sample(self, x: torch.Tensor, bounds: list[tuple[int, int, int]]) -> torch.Tensor:
        """``x`` [s, b, h] through the HF module, one HF row per ``(row, start, end)``."""
        s, b, h = x.shape
        flat = x.transpose(0, 1).reshape(b * s, h)
        width = max(end - start for _, start, end in bounds)
        index = torch.full((len(bounds), width), b * s, dtype=torch.long)  # b*s: a zero pad
        for i, (row, start, end) in enumerate(bounds):
            index[i, :end - start] = torch.arange(row * s + start, row * s + end)
        index = index.to(x.device)
        rows = torch.cat([flat, flat.new_zeros(1, h)]).index_select(0, index.flatten())
        out = self.linear_attn(rows.view(len(bounds), width, h)).reshape(-1, h)
        keep = index.flatten() < b * s
        result = flat.new_zeros(b * s, h).index_copy(0, index.flatten()[keep], out[keep])
        return result.view(b, s, h).transpose(0, 1).contiguous()


def _sample_bounds(shape, attention_mask, lengths) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every sample in an ``[s, b, h]`` input (module docstring)."""
    s, b = shape[0], shape[1]
    if lengths is not None:  # THD: one row of samples back to back
        ends = np.cumsum(lengths).tolist()
        return [(0, end - n, end) for n, end in zip(lengths, ends) if n > 0]
    if attention_mask is None:
        return [(row, 0, s) for row in range(b)]
    # True = blocked; a position blocked from its predecessor starts a sample
    breaks = attention_mask[:, 0].diagonal(offset=-1, dim1=-2, dim2=-1)  # [b or 1, s-1]
    bounds = []
    for row in range(b):
        starts = [0, *(torch.nonzero(breaks[min(row, breaks.shape[0] - 1)]).flatten() + 1)
                  .tolist()]
        bounds += [(row, a, e) for a, e in zip(starts, [*starts[1:], s])]
    return bounds


def linear_attention_spec(hf_config, hf_class: type) -> ModuleSpec:
    """The ``self_attention`` spec of a linear-attention layer of ``hf_config`` (the HF text
    config; ``hf_class`` is the family's gated delta-net module)."""
    return ModuleSpec(module=LinearAttention, params={"hf_class": hf_class,
                                                      "hf_config": hf_config})
