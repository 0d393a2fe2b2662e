"""RoPE scaling from an HF config to Megatron's rotary embedding (Llama-3.x, linear, YaRN).

What each HF ``rope_type`` becomes:

- ``default``: plain RoPE.
- ``linear`` (factor ``f``): positions divided by ``f``, Megatron's
  ``seq_len_interpolation_factor=f`` (HF divides the frequencies instead: the same angles).
- ``llama3`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
  ``original_max_position_embeddings``): Megatron's ``rope_scaling=True`` hard-codes low 1,
  high 4 and 8192 original positions, so :func:`apply_rope_scaling` rebuilds the frequencies
  with Megatron's own ``_apply_scaling`` called with the checkpoint's four values, on every
  model chunk after construction (before any forward: the embedding caches per length).
- ``yarn`` (``factor``, ``original_max_position_embeddings``, ``beta_fast`` / ``beta_slow``,
  ``truncate``, ``mscale`` / ``mscale_all_dim``) for the model types of ``YARN_MODEL_TYPES``
  (gpt-oss, whose test checks it against transformers): ``GPTModel``'s
  ``position_embedding_type="yarn"``, whose ``YarnRotaryEmbedding`` and attention read the
  ``yarn_*`` attributes :func:`yarn_config_fields` gives (Megatron declares no such
  ``TransformerConfig`` fields; it reads them with ``getattr``). transformers' ``truncate`` is
  Megatron's ``correction_range_round_to_int``; its cos/sin factor (``get_mscale(factor)``, or
  the ratio of the two mscales when both are set) is Megatron's concentration factor. A stated
  ``attention_factor`` is refused (Megatron derives it). MLA models apply their own YaRN
  (``mla_bridge``); other model types' YaRN stays refused until a test checks it.
- anything else (``dynamic``, ``longrope``): refused, naming the type.

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
# non-MLA model types whose YaRN vime builds on Megatron's GPT path (module docstring)
YARN_MODEL_TYPES: tuple[str, ...] = ("gpt_oss",)
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
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float | None = None
    mscale_all_dim: float | None = None


def rope_scaling_of(rope: Mapping | None, model_type: str | None = None) -> RopeScaling:
    """The scaling described by an HF ``rope_parameters`` / ``rope_scaling`` mapping of a
    ``model_type`` checkpoint; raises ``ModelLoadError`` for a type Megatron's rotary embedding
    cannot reproduce (YaRN: for ``YARN_MODEL_TYPES`` only)."""
    rope = dict(rope or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "yarn" and model_type in YARN_MODEL_TYPES:
        return _yarn(rope)
    if kind not in ROPE_TYPES:
        raise ModelLoadError(
            f"rope_parameters.rope_type={kind!r}: not reproducible by Megatron's rotary "
            f"embedding through the bridge for model_type {model_type!r} (vime supports "
            f"{list(ROPE_TYPES)}, and yarn for {list(YARN_MODEL_TYPES)}). Fix: use a "
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


def _yarn(rope: dict) -> RopeScaling:
    """transformers' ``_compute_yarn_parameters`` inputs, with its defaults."""
    missing = [k for k in ("factor", "original_max_position_embeddings") if rope.get(k) is None]
    if missing:
        raise ModelLoadError(f"rope_parameters={rope!r}: rope_type 'yarn' lacks {missing}. "
                             "Fix: complete the checkpoint's config.json.")
    if rope.get("attention_factor") is not None:
        raise ModelLoadError(f"rope_parameters.attention_factor={rope['attention_factor']!r}: "
                             "Megatron derives YaRN's cos/sin factor from factor and mscale. "
                             "Fix: drop the key if it equals that, or convert the RoPE offline.")
    both = bool(rope.get("mscale")) and bool(rope.get("mscale_all_dim"))  # as transformers
    return RopeScaling(kind="yarn", factor=float(rope["factor"]),
                       original_max_position_embeddings=int(
                           rope["original_max_position_embeddings"]),
                       beta_fast=float(rope.get("beta_fast") or 32.0),
                       beta_slow=float(rope.get("beta_slow") or 1.0),
                       truncate=bool(rope.get("truncate", True)),
                       mscale=float(rope["mscale"]) if both else None,
                       mscale_all_dim=float(rope["mscale_all_dim"]) if both else None)


def gpt_rope_args(scaling: RopeScaling) -> dict[str, object]:
    """``GPTModel`` keyword arguments for ``scaling`` (llama3 is applied after construction)."""
    if scaling.kind == "linear":
        return {"seq_len_interpolation_factor": scaling.factor}
    if scaling.kind == "yarn":
        return {"position_embedding_type": "yarn"}
    return {}


def yarn_config_fields(scaling: RopeScaling) -> dict[str, object]:
    """The ``yarn_*`` attributes Megatron's GPT path reads from the ``TransformerConfig``
    (module docstring); empty unless ``scaling`` is YaRN."""
    if scaling.kind != "yarn":
        return {}
    return {"yarn_rotary_scaling_factor": scaling.factor,
            "yarn_original_max_position_embeddings": scaling.original_max_position_embeddings,
            "yarn_beta_fast": scaling.beta_fast, "yarn_beta_slow": scaling.beta_slow,
            "yarn_mscale": scaling.mscale, "yarn_mscale_all_dim": scaling.mscale_all_dim,
            "yarn_correction_range_round_to_int": scaling.truncate}


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

