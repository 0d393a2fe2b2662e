"""How Hugging Face names a checkpoint's tensors, against how transformers names the model's
parameters in memory: the two places they differ, read by the engines and the trainer.

- MoE experts: checkpoints (and the trainer's export) name each expert
  ``experts.{e}.gate_proj.weight`` ``[I, H]``; transformers 5 holds a layer's experts fused,
  ``experts.gate_up_proj`` ``[E, 2 * I, H]`` (gate rows, then up rows) and ``experts.down_proj``
  ``[E, H, I]``, and some checkpoints are written so (Qwen3.5-MoE's release). Mixtral's
  layout (MiniMax-M2's) names the projections ``w1`` (gate), ``w3`` (up) and ``w2`` (down)
  under ``block_sparse_moe``, which transformers loads as ``mlp``.
- Multimodal layout: transformers writes some text models (Qwen3.5's) under
  ``model.language_model.`` and loads them as ``model.``.

Example: ``fused_expert_name("model.layers.0.mlp.experts.3.up_proj.weight")`` is
``"model.layers.0.mlp.experts.gate_up_proj"``, and :func:`fused_expert_slice` the expert's
rows of it.
"""

import re

import torch

_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)"
                          r"\.weight$")
# Mixtral's (and MiniMax-M2's) names of an expert's projections
_PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate",
                "w3": "up", "w2": "down"}
_TEXT_PREFIX = "model.language_model."  # a multimodal checkpoint's text model (in_memory_name)


def fused_expert_slice(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The view of the fused expert tensors in ``params`` that a per-expert name is, or None
    (module docstring). Example: ``model.layers.0.mlp.experts.3.up_proj.weight`` is
    ``params["model.layers.0.mlp.experts.gate_up_proj"][3, I:]``."""
    match = _EXPERT_NAME.match(name)
    fused = params.get(fused_expert_name(name) or "")
    if match is None or fused is None:
        return None
    expert, proj = int(match.group(2)), _PROJECTIONS[match.group(3)]
    if proj == "down":
        return fused[expert]
    half = fused.shape[1] // 2
    return fused[expert, :half] if proj == "gate" else fused[expert, half:]


def in_memory_name(name: str) -> str:
    """The model's own name for a checkpoint name (module docstring: the multimodal layout's
    prefix, Mixtral's ``block_sparse_moe``). Example: ``model.language_model.norm.weight`` ->
    ``model.norm.weight``."""
    name = "model." + name.removeprefix(_TEXT_PREFIX) if name.startswith(_TEXT_PREFIX) else name
    return name.replace(".block_sparse_moe.", ".mlp.")


def fused_expert_name(name: str) -> str | None:
    """The fused parameter a per-expert checkpoint name belongs to (:func:`fused_expert_slice`).
    Example: ``...experts.3.gate_proj.weight`` -> ``...experts.gate_up_proj``."""
    match = _EXPERT_NAME.match(name)
    if match is None:
        return None
    fused = "down_proj" if _PROJECTIONS[match.group(3)] == "down" else "gate_up_proj"
    return f"{match.group(1)}.{fused}"
