"""The mbridge adjustments MoE models (Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GLM-4.5) need,
measured on CPU.

1. Local spec experts: ``moe_grouped_gemm=False`` and ``moe_shared_expert_overlap=False``
   (``Platform.transformer_overrides``): Megatron's ``SequentialMLP``, as the grouped GEMM needs
   a CUDA kernel.
2. Names: ``SequentialMLP`` names its weights ``mlp.experts.local_experts.{i}.linear_fc{k}.weight``
   where mbridge expects the grouped form ``mlp.experts.linear_fc{k}.weight{i}``;
   :func:`map_sequential_experts` renames them (and numbers them globally under EP, the way
   mbridge does for the grouped form), so loading and export go through mbridge's expert paths.
3. Router semantics (:func:`router_fields`): ``moe_router_pre_softmax = not norm_topk_prob``
   (mbridge hard-codes False for Qwen3-MoE: logits 0.30 off with ``norm_topk_prob=False``), and
   ``moe_shared_expert_gate=True`` for Qwen2-MoE (mbridge omits the sigmoid gate: logits 0.72
   off, export misses 2 tensors).

4. Export order (:func:`expert_bias_in_layer_order`): Megatron keeps DeepSeek-V3's router
   ``expert_bias`` as a buffer, which mbridge exports after every parameter of the chunk, so a
   weight sync would send it after its layer was already reloaded (vime's sync refuses that
   order: vLLM rebuilds a layer from one call). As a frozen parameter it is exported inside
   its layer; nothing trains it (no gradient, no optimizer state, and the update rate is 0).

5. GLM-4.5 / 4.6 / 4.7 (``glm4_moe``, mbridge's bridge): its shared expert is
   ``n_shared_experts`` experts wide (mbridge assumes one), and its router is group-limited
   by ``n_group`` / ``topk_group`` (mbridge leaves them out).

6. Fused checkpoints (:class:`FusedExpertReader`): mbridge reads each expert by its own name;
   a checkpoint that stores a layer's experts fused (``experts.gate_up_proj`` ``[E, 2I, H]``,
   Qwen3.5-MoE's release) is read through the expert's slice of the fused tensor. The export
   names experts one by one, as transformers 5 writes them and loads either form.

Result measured with these: logits within 9.5e-7 of transformers at EP1, EP2 and TP2, export
bit-exact.

Example: ``map_sequential_experts({"decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight":
"decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"}, ep_rank=1, experts_per_rank=2)``
maps the name to ``decoder.layers.0.mlp.experts.linear_fc2.weight3``.
"""

import re
from collections.abc import Callable

import torch

from vime_shell.models.hf_config import EXPERT_KEYS, SIGMOID_ROUTERS, ModelLoadError
from vime_shell.models.hf_names import fused_expert_name, fused_expert_slice

_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def num_experts_of(hf_config) -> int | None:
    """Routed experts of an HF config (``num_experts``, Mixtral's ``num_local_experts``);
    None for a dense model."""
    for key in EXPERT_KEYS:
        value = getattr(hf_config, key, None)
        if value:
            return int(value)
    return None


def router_fields(hf_config) -> dict[str, object]:
    """``TransformerConfig`` fields that make Megatron's router compute what the HF model
    does (adjustment 3); empty for a dense model. Refuses MoE layouts mbridge maps wrongly."""
    if num_experts_of(hf_config) is None:
        return {}
    dense = list(getattr(hf_config, "mlp_only_layers", None) or [])
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    if dense or step != 1:
        raise ModelLoadError(
            f"mlp_only_layers={dense}, decoder_sparse_step={step}: dense layers among the MoE "
            "layers are not mapped by the bridge. Fix: use a checkpoint whose every layer is "
            "MoE (mlp_only_layers=[], decoder_sparse_step=1).")
    if getattr(hf_config, "model_type", None) in SIGMOID_ROUTERS and \
            not getattr(hf_config, "norm_topk_prob", True):
        raise ModelLoadError(
            "norm_topk_prob=false: a DeepSeek-V3 router that keeps its sigmoid top-k scores "
            "unnormalised; Megatron's sigmoid router always renormalises them (its pre-softmax "
            "switch applies to softmax routers only). Fix: use a checkpoint with "
            "norm_topk_prob true, as DeepSeek-V3, R1 and Moonlight have it.")
    fields: dict[str, object] = {}
    if hasattr(hf_config, "norm_topk_prob"):
        fields["moe_router_pre_softmax"] = not bool(hf_config.norm_topk_prob)
    if getattr(hf_config, "model_type", None) == "qwen2_moe":
        fields["moe_shared_expert_gate"] = True
    if getattr(hf_config, "model_type", None) == "glm4_moe":  # adjustment 5
        fields["moe_shared_expert_intermediate_size"] = (
            hf_config.moe_intermediate_size * getattr(hf_config, "n_shared_experts", 1))
        if (getattr(hf_config, "n_group", 1) or 1) > 1:
            fields["moe_router_num_groups"] = hf_config.n_group
            fields["moe_router_group_topk"] = hf_config.topk_group
    return fields


def map_sequential_experts(names: dict[str, str], *, ep_rank: int,
                           experts_per_rank: int) -> dict[str, str]:
    """Rename ``SequentialMLP`` expert weights in a local -> global name map (adjustment 2);
    ``experts_per_rank * ep_rank`` offsets the index (pass ``ep_rank=0`` for local numbering)."""
    out = {}
    for local, name in names.items():
        match = _LOCAL_EXPERT.match(name)
        if match:
            prefix, index, fc = match.groups()
            name = f"{prefix}.{fc}.weight{int(index) + ep_rank * experts_per_rank}"
        out[local] = name
    return out


def expert_bias_in_layer_order(chunk: torch.nn.Module) -> None:
    """Each router's ``expert_bias`` buffer as a frozen parameter (adjustment 4), in place."""
    for module in chunk.modules():
        bias = module._buffers.pop("expert_bias", None)
        if bias is not None:
            module.expert_bias = torch.nn.Parameter(bias, requires_grad=False)


class FusedExpertReader:
    """mbridge's ``SafeTensorIO`` reading a per-expert name missing from the checkpoint out of
    its layer's fused tensor (adjustment 6); every other name, and every other method, as
    mbridge's. ``fused_name`` (a per-expert name -> its fused tensor's name, or None) and
    ``expert_slice`` (the loaded fused tensors, a per-expert name -> its slice) are the
    checkpoint's layout: ``hf_names``' (Qwen3.5-MoE's) unless a bridge states its own
    (``FUSED_EXPERTS``: gpt-oss's)."""

    def __init__(self, io, fused_name: Callable[[str], str | None] = fused_expert_name,
                 expert_slice: Callable[[dict[str, torch.Tensor], str], torch.Tensor | None]
                 = fused_expert_slice):
        self.io, self.fused_name, self.expert_slice = io, fused_name, expert_slice
        self.names = set(io.load_hf_weight_names())

    def __getattr__(self, name: str):
        return getattr(self.io, name)

    def load_some_hf_weight(self, names: list[str]) -> dict[str, torch.Tensor]:
        fused = {n: self.fused_name(n) for n in names if n not in self.names}
        out = self.io.load_some_hf_weight([n for n in names if n in self.names])
        absent = sorted(n for n, f in fused.items() if f not in self.names)
        if absent:
            raise ModelLoadError(
                f"{self.io.hf_dir!r}: the checkpoint has no {absent[0]!r}"
                + (f" and no {fused[absent[0]]!r}" if fused[absent[0]] else "")
                + f" ({len(absent)} tensors missing). Fix: point --hf-checkpoint at a complete "
                "checkpoint of this model.")
        tensors = self.io.load_some_hf_weight(sorted({f for f in fused.values() if f}))
        for name in fused:
            expert = self.expert_slice(tensors, name)
            assert expert is not None  # every sliced name's fused tensor was found above
            out[name] = expert.clone()
        return out

    def load_one_hf_weight(self, name: str) -> torch.Tensor:
        return self.load_some_hf_weight([name])[name]
