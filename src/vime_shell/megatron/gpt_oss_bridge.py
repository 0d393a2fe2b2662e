"""gpt-oss (``model_type`` ``gpt_oss``; miles' ``--softmax-type learnable --window-size 128,0
--window-attn-skip-freq 2``): Megatron's GPT layers with gpt-oss's attention and experts, and
the HF mapping.

No kept library maps it (mbridge 0.15 has no gpt-oss bridge), so vime writes the mapping here,
matching transformers 5's ``models/gpt_oss`` line by line:

- **Attention sinks**: one learnable logit per head (HF ``self_attn.sinks``) joins every
  query's softmax as an extra column and is dropped after it. Megatron's config calls this
  ``softmax_type="learnable"`` (its ``softmax_offset``); :class:`GptOssCoreAttention` holds it,
  split over TP with the heads.
- **Sliding window on alternating layers** (HF ``layer_types``, ``sliding_window`` W): a
  sliding layer's query sees itself and the ``W - 1`` tokens before it (Megatron's
  ``window_size=(W - 1, 0)``, ``window_attn_skip_freq`` the per-layer 0/1 list). Megatron's
  local attention *replaces* the given mask by its window mask, which would let a packed
  row's samples see each other; :class:`GptOssCoreAttention` instead blocks what the
  record's mask blocks (other samples, the future) *and* what lies beyond the window.
- **Biases everywhere** (``add_bias_linear``): q/k/v, o, the router and every expert's two
  projections (the down projection's bias weighted by the routing probability, as
  transformers' experts add it before weighting).
- **Router**: a biased linear, top-k of the logits, softmax over the k picked (Megatron's
  softmax router with ``moe_router_pre_softmax=False``), no shared expert, no load balancing.
- **Experts**: transformers' clamped SwiGLU, ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha *
  g)`` with ``g = clamp(gate, max=l)`` (``swiglu_alpha``, ``swiglu_limit``): Megatron's
  ``activation_func_clamp_value=l`` and ``glu_linear_offset=1`` around
  :func:`sigmoid_gated`. On disk a layer's experts are fused: ``experts.gate_up_proj``
  ``[E, H, 2I]`` with gate and up *interleaved* along the last axis (gate in the even
  columns), ``experts.down_proj`` ``[E, I, H]`` (both ``x @ W``), and the biases
  ``gate_up_proj_bias`` ``[E, 2I]`` (interleaved too) and ``down_proj_bias`` ``[E, H]``.
  Loading slices an expert out of them (``FUSED_EXPERTS``, read by ``moe_bridge``'s
  ``FusedExpertReader``); export stacks each layer's experts back into those four tensors,
  so ``--save-hf`` writes the checkpoint's own names.
- **RoPE**: YaRN (``vime_shell.megatron.rope``), on halves of each head (not interleaved).

Refused (``ModelLoadError``): the MXFP4-quantised release (``*_blocks`` / ``*_scales``
expert tensors: use a bf16 copy such as the one miles' script names), and TransformerEngine's
spec (this attention is the local spec's; THD packing would need a sink- and window-aware TE
kernel that no CPU run can check). ``run.model_checks`` refuses TP and EP above 1 at launch.

Example: ``GptOss(hf_config, dtype=torch.float32)`` is the bridge of a ``gpt_oss`` checkpoint
(``bridge.make_bridge`` picks it by ``model_type``).
"""

import functools
import math
import re
from collections.abc import Generator

import torch
from mbridge.core.llm_bridge import LLMBridge
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from vime_shell.megatron.attention import causal_mask, softmax_attention
from vime_shell.models.hf_config import ModelLoadError

# a Megatron expert parameter: the grouped form (vime's SequentialMLP rename, weights) or the
# local form (biases keep it) -> layer, expert, fc, kind
_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.(?:linear_(fc[12])\.(weight|bias)"
                     r"(\d+)|local_experts\.(\d+)\.linear_(fc[12])\.(weight|bias))$")
# the HF name of one expert's slice of a fused tensor (vime's own, never on disk)
_SLICE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_up_proj|down_proj)"
                    r"(_bias)?$")
_FUSED = {("fc1", "weight"): "gate_up_proj", ("fc1", "bias"): "gate_up_proj_bias",
          ("fc2", "weight"): "down_proj", ("fc2", "bias"): "down_proj_bias"}


def sigmoid_gated(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """gpt-oss's gate activation ``x * sigmoid(alpha * x)`` (Megatron's quick_gelu at 1.702)."""
    return x * torch.sigmoid(alpha * x)


class GptOssCoreAttention(MegatronModule):
    """Softmax attention with gpt-oss's sinks and this layer's sliding window, on the local
    spec: queries ``[s, b, heads, d]``, keys and values ``[s, b, groups, d]``, the record's mask
    ``[b or 1, 1, s, s]`` with True where a token may not look (causal when None). Returns
    ``[s, b, heads * d]``, as ``DotProductAttention`` does."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None, **_):
        super().__init__(config=config)
        tp = config.tensor_model_parallel_size
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.softmax_scale = softmax_scale if softmax_scale is not None \
            else 1.0 / math.sqrt(config.kv_channels)
        window = is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                           layer_number)
        self.window_left = int(config.window_size[0]) if window else None
        self.softmax_offset = torch.nn.Parameter(torch.zeros(self.heads,
                                                             dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.softmax_offset, is_parallel=True, dim=0,
                                             stride=1)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None:
            raise ModelLoadError("gpt-oss's attention runs on packed rows with a mask (the "
                                 "local spec), not THD. Fix: train gpt-oss without "
                                 "TransformerEngine.")
        blocked = self._blocked(attention_mask, query.shape[0], query.device)
        return softmax_attention(query, key, value, blocked, self.softmax_scale,
                                 sinks=self.softmax_offset)

    def _blocked(self, mask, s: int, device) -> torch.Tensor:
        """The record's mask (or causal), and beyond the window on a sliding layer: packed
        samples stay apart whatever the window (module docstring)."""
        if mask is None:
            mask = causal_mask(s, device)
        if self.window_left is None:
            return mask
        i = torch.arange(s, device=device)
        return mask | ((i[:, None] - i[None, :]) > self.window_left)


class _OwnOutput:
    """An expert's down projection whose output is a tensor of its own: Megatron's expert MLP
    adds the probability-weighted bias to it in place, which autograd refuses on the view the
    TP region returns at expert-TP 1 (a ``RuntimeError`` in the first backward)."""

    def forward(self, *args, **kwargs):
        output, bias = super().forward(*args, **kwargs)
        return output.clone(), bias


def with_gpt_oss_attention(spec, *, transformer_engine: bool):
    """``spec`` (a decoder block spec) with :class:`GptOssCoreAttention` in every layer and the
    experts' down projections as :class:`_OwnOutput`; the TransformerEngine spec is refused
    (module docstring)."""
    if transformer_engine:
        raise ModelLoadError("gpt-oss's attention sinks and sliding window are built on "
                             "Megatron's local spec only (vime checks them on CPU against "
                             "transformers); TransformerEngine's THD packing is not. Fix: "
                             "train gpt-oss without transformer_engine installed.")
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = GptOssCoreAttention
        experts = layer.submodules.mlp.submodules.experts.submodules
        if not issubclass(experts.linear_fc2, _OwnOutput):  # layers may share one record
            experts.linear_fc2 = type(f"OwnOutput{experts.linear_fc2.__name__}",
                                      (_OwnOutput, experts.linear_fc2), {})
    return spec


def expert_of(name: str) -> tuple[str, int] | None:
    """The checkpoint's fused tensor an expert's slice belongs to and the expert
    (``...experts.3.gate_up_proj`` -> ``(...experts.gate_up_proj, 3)``), or None."""
    m = _SLICE.match(name)
    return None if m is None else (f"{m.group(1)}.{m.group(3)}{m.group(4) or ''}",
                                   int(m.group(2)))


def fused_name_of(name: str) -> str | None:
    """The fused tensor of an expert's slice, or None: gpt-oss's ``FUSED_EXPERTS`` layout for
    ``moe_bridge.FusedExpertReader``."""
    slot = expert_of(name)
    return None if slot is None else slot[0]


def expert_slice_of(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """An expert's slice of the loaded fused tensors (``experts.gate_up_proj[3]``), or None."""
    slot = expert_of(name)
    fused = None if slot is None else tensors.get(slot[0])
    return None if fused is None or slot is None else fused[slot[1]]


def _refuse_mxfp4(io) -> None:
    """The MXFP4-quantised release (``*_blocks`` / ``*_scales`` expert tensors) is refused."""
    quantised = [n for n in io.load_hf_weight_names() if n.endswith(("_blocks", "_scales"))]
    if quantised:
        raise ModelLoadError(
            f"{io.hf_dir!r}: holds MXFP4-quantised experts ({quantised[0]!r}, "
            f"{len(quantised)} such tensors); vime trains the bf16 or fp32 weights. Fix: "
            "point --hf-checkpoint at a dequantised copy (gpt-oss-20b-BF16 style: "
            "experts.gate_up_proj / down_proj and their biases).")


def expert_key(mcore_name: str) -> tuple[int, int, str, str] | None:
    """``(layer, expert, fc, kind)`` of a Megatron expert parameter, else None."""
    m = _EXPERT.match(mcore_name)
    if m is None:
        return None
    if m.group(2):
        return int(m.group(1)), int(m.group(4)), m.group(2), m.group(3)
    return int(m.group(1)), int(m.group(5)), m.group(6), m.group(7)


def to_megatron(fc: str, kind: str, hf: torch.Tensor) -> torch.Tensor:
    """One expert's HF slice (``x @ W`` layout, gate/up interleaved) as Megatron's
    ``linear_fc1`` (gate rows, then up rows) / ``linear_fc2`` (``W x`` layout)."""
    if fc == "fc2":
        return hf.t().contiguous() if kind == "weight" else hf
    gate, up = (hf[..., 0::2], hf[..., 1::2])
    if kind == "weight":
        gate, up = gate.t(), up.t()
    return torch.cat([gate, up], dim=0).contiguous()


def to_hf(fc: str, kind: str, mcore: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_megatron`."""
    if fc == "fc2":
        return mcore.t().contiguous() if kind == "weight" else mcore
    gate, up = mcore.chunk(2, dim=0)
    if kind == "weight":
        gate, up = gate.t(), up.t()
    return torch.stack([gate, up], dim=-1).flatten(-2).contiguous()


class GptOss(LLMBridge):
    """vime's gpt-oss bridge on mbridge's LLM bridge (module docstring)."""

    _DIRECT_MAPPING = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
    }
    _ATTENTION_MAPPING = {
        "self_attention.linear_proj.weight": ["model.layers.{layer_number}.self_attn.o_proj.weight"],
        "self_attention.linear_proj.bias": ["model.layers.{layer_number}.self_attn.o_proj.bias"],
        "self_attention.core_attention.softmax_offset": [
            "model.layers.{layer_number}.self_attn.sinks"],
        "self_attention.linear_qkv.weight": [
            f"model.layers.{{layer_number}}.self_attn.{p}_proj.weight" for p in "qkv"],
        "self_attention.linear_qkv.bias": [
            f"model.layers.{{layer_number}}.self_attn.{p}_proj.bias" for p in "qkv"],
    }
    _MLP_MAPPING = {
        "mlp.router.weight": ["model.layers.{layer_number}.mlp.router.weight"],
        "mlp.router.bias": ["model.layers.{layer_number}.mlp.router.bias"],
    }

    @staticmethod
    def adapt_layer_spec(spec, *, transformer_engine: bool, vp_stage=None):
        return with_gpt_oss_attention(spec, transformer_engine=transformer_engine)

    def _build_config(self):
        hf = self.hf_config
        sliding = [int(t == "sliding_attention") for t in hf.layer_types]
        window = {"window_size": (int(hf.sliding_window) - 1, 0),
                  "window_attn_skip_freq": sliding} if any(sliding) else {}
        return self._build_base_config(
            add_bias_linear=True, add_qkv_bias=True, qk_layernorm=False,
            kv_channels=hf.head_dim, softmax_type="learnable", **window,
            activation_func=functools.partial(sigmoid_gated, alpha=float(hf.swiglu_alpha)),
            activation_func_clamp_value=float(hf.swiglu_limit), glu_linear_offset=1.0,
            num_moe_experts=hf.num_local_experts, moe_router_topk=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.intermediate_size, moe_router_score_function="softmax",
            moe_router_pre_softmax=False, moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0, moe_router_dtype="fp32",
            moe_shared_expert_intermediate_size=None)

    # the checkpoint's experts, read by bridge.make_bridge's moe_bridge.FusedExpertReader
    FUSED_EXPERTS = (fused_name_of, expert_slice_of)

    def _get_safetensor_io(self, weights_path: str):
        io = super()._get_safetensor_io(weights_path)
        _refuse_mxfp4(io)
        return io

    def _weight_name_mapping_mlp(self, name: str) -> list[str]:
        key = expert_key(name)
        if key is None:
            return super()._weight_name_mapping_mlp(name)
        layer, expert, fc, kind = key
        return [f"model.layers.{layer}.mlp.experts.{expert}.{_FUSED[fc, kind]}"]

    def _weight_to_mcore_format(self, mcore_weights_name, hf_weights):
        key = expert_key(mcore_weights_name)
        if key is None:
            return super()._weight_to_mcore_format(mcore_weights_name, hf_weights)
        return to_megatron(key[2], key[3], hf_weights[0].to(self.dtype))

    def _weight_to_hf_format(self, mcore_weights_name, mcore_weights):
        key = expert_key(mcore_weights_name)
        if key is None:
            return super()._weight_to_hf_format(mcore_weights_name, mcore_weights)
        return (self._weight_name_mapping_mcore_to_hf(mcore_weights_name),
                [to_hf(key[2], key[3], mcore_weights)])

    def export_weights(self, models) -> Generator[tuple[str, torch.Tensor], None, None]:
        """mbridge's export, each layer's experts stacked into the checkpoint's fused tensors
        (each yielded once its last expert arrives: one layer's experts held at a time)."""
        experts = int(self.hf_config.num_local_experts)
        pending: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in super().export_weights(models):
            slot = expert_of(name)
            if slot is None:
                yield name, tensor
                continue
            fused, expert = slot
            pending.setdefault(fused, {})[expert] = tensor
            if len(pending[fused]) == experts:
                parts = pending.pop(fused)
                yield fused, torch.stack([parts[e] for e in range(experts)])
        if pending:
            raise ModelLoadError(f"export: {sorted(pending)[0]} got {len(next(iter(pending.values())))} "
                                 f"of {experts} experts. Fix: report this (an expert-parallel "
                                 "export must gather every expert).")
