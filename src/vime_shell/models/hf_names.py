"""How Hugging Face names a checkpoint's tensors, against how transformers names the model's
parameters in memory: the two places they differ, read by the engines and the trainer.

- MoE experts: checkpoints (and the trainer's export) name each expert
  ``experts.{e}.gate_proj.weight`` ``[I, H]``; transformers 5 holds a layer's experts fused,
  ``experts.gate_up_proj`` ``[E, 2 * I, H]`` (gate rows, then up rows) and ``experts.down_proj``
  ``[E, H, I]``, and some checkpoints are written so (Qwen3.5-MoE's release).
- Multimodal layout: transformers writes some text models (Qwen3.5's) under
  ``model.language_model.`` and loads them as ``model.``.

Example: ``fused_expert_name("model.layers.0.mlp.experts.3.up_proj.weight")`` is
``"model.layers.0.mlp.experts.gate_up_proj"``, and :func:`fused_expert_slice` the expert's
rows of it.
"""

import re

import torch

_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_TEXT_PREFIX = "model.language_model."  # a multimodal checkpoint's text model (in_memory_name)


def fused_expert_slice(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The view of the fused expert tensors in ``params`` that a per-expert name is, or None
    (module docstring). Example: ``model.layers.0.mlp.experts.3.up_proj.weight`` is
    ``params["model.layers.0.mlp.experts.gate_up_proj"][3, I:]``."""
    match = _EXPERT_NAME.match(name)
    fused = params.get(fused_expert_name(name) or "")
    if match is None or fused is None:
        return None
    expert, proj = int(match.group(2)), match.group(3)
    if proj == "down":
        return fused[expert]
    half = fused.shape[1] // 2
    return fused[expert, :half] if proj == "gate" else fused[expert, half:]


def in_memory_name(name: str) -> str:
    """The model's own name for a checkpoint name: transformers writes some text models
    (Qwen3.5's) under the multimodal layout's ``model.language_model.`` and loads them as
    ``model.``. Example: ``model.language_model.norm.weight`` -> ``model.norm.weight``."""
    return "model." + name.removeprefix(_TEXT_PREFIX) if name.startswith(_TEXT_PREFIX) else name


def fused_expert_name(name: str) -> str | None:
    """The fused parameter a per-expert checkpoint name belongs to (:func:`fused_expert_slice`).
    Example: ``...experts.3.gate_proj.weight`` -> ``...experts.gate_up_proj``."""
    match = _EXPERT_NAME.match(name)
    if match is None:
        return None
    return f"{match.group(1)}.{'down_proj' if match.group(3) == 'down' else 'gate_up_proj'}"
