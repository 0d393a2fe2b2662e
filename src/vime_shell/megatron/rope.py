"""RoPE scaling from an HF config to Megatron's rotary embedding (Llama-3.x, linear).

What each HF ``rope_type`` becomes:

- ``default``: plain RoPE.
- ``linear`` (factor ``f``): positions divided by ``f``, Megatron's
  ``seq_len_interpolation_factor=f`` (HF divides the frequencies instead: the same angles).
- ``llama3`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
  ``original_max_position_embeddings``): Megatron's ``rope_scaling=True`` hard-codes low 1,
  high 4 and 8192 original positions, so :func:`apply_rope_scaling` rebuilds the frequencies
  with Megatron's own ``_apply_scaling`` called with the checkpoint's four values, on every
  model chunk after construction (before any forward: the embedding caches per length).
- anything else (``yarn``, ``dynamic``, ``longrope``): refused, naming the type. Megatron's
  YaRN embedding reads MLA-only config fields, and mbridge maps none of them for these models.

mbridge 0.15.1 would drop the scaling under transformers 5 (it tests ``"rope_scaling" in
config``, False there: logits 1.4e-2 off) and, where it does not, passes a llama3 factor as a
linear interpolation factor; the bridge uses :func:`gpt_rope_args` instead of its own.

Example: ``rope_scaling_of({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
"high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_theta": 5e5})``
gives ``RopeScaling(kind="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
original_max_position_embeddings=8192)``.
"""

from collections.abc import Mapping

import attrs
import torch

from vime_shell.models.hf_config import ModelLoadError

ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")


@attrs.frozen(kw_only=True)
class RopeScaling:
    """A supported RoPE scaling; ``kind="default"`` is none."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


def rope_scaling_of(rope: Mapping | None) -> RopeScaling:
    """The scaling described by an HF ``rope_parameters`` / ``rope_scaling`` mapping; raises
    ``ModelLoadError`` for a type Megatron's rotary embedding cannot reproduce."""
    rope = dict(rope or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ModelLoadError(
            f"rope_parameters.rope_type={kind!r}: not reproducible by Megatron's rotary "
            f"embedding through the bridge (vime supports {list(ROPE_TYPES)}). Fix: use a "
            "checkpoint with one of those, or convert its RoPE offline.")
    if kind == "default":
        return RopeScaling()
    missing = [k for k in (_LLAMA3_KEYS if kind == "llama3" else ("factor",)) if k not in rope]
    if missing:
        raise ModelLoadError(f"rope_parameters={rope!r}: rope_type {kind!r} lacks {missing}. "
                             "Fix: complete the checkpoint's config.json.")
    factor = float(rope["factor"])
    if not factor > 0:
        raise ModelLoadError(f"rope_parameters.factor={factor!r}: must be positive. Fix: "
                             "correct the checkpoint's config.json.")
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    if not high > low:
        raise ModelLoadError(f"rope_parameters: high_freq_factor={high} must exceed "
                             f"low_freq_factor={low}. Fix: correct the checkpoint's config.json.")
    return RopeScaling(kind="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                       original_max_position_embeddings=int(
                           rope["original_max_position_embeddings"]))


def gpt_rope_args(scaling: RopeScaling) -> dict[str, object]:
    """``GPTModel`` keyword arguments for ``scaling`` (llama3 is applied after construction)."""
    if scaling.kind == "linear":
        return {"seq_len_interpolation_factor": scaling.factor}
    return {}


def apply_rope_scaling(model: torch.nn.Module, scaling: RopeScaling) -> None:
    """Rebuild a chunk's llama3 frequencies with the checkpoint's parameters (see module)."""
    if scaling.kind != "llama3":
        return
    emb = getattr(model, "rotary_pos_emb", None)
    if emb is None:
        return
    emb.inv_freq = emb._apply_scaling(
        emb.inv_freq, factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
        high_freq_factor=scaling.high_freq_factor,
        original_max_position_embeddings=scaling.original_max_position_embeddings)

