"""Which linear layers get LoRA adapters, at what rank and scale (torch-free, checked at launch).

miles' flags and meanings: ``--lora-rank R`` (0: off), ``--lora-alpha A`` (the update is
``A / R x B A``), ``--lora-dropout`` (must be 0 here, as vime's other dropouts: the log-prob
ratio of RL needs a deterministic forward), ``--target-modules`` (``all-linear``, or HF or
Megatron module names, comma-separated), ``--exclude-modules`` and
``--experts-shared-outer-loras``.

On a MoE layer ``gate_proj`` / ``up_proj`` / ``down_proj`` (``linear_fc1`` / ``linear_fc2``)
adapt every routed expert's linear layers (and a shared expert's, a plain MLP), as miles'
Megatron-Bridge LoRA matches every module of that name. By default each routed expert has its
own ``A`` and ``B`` (miles' per-expert layout). ``--experts-shared-outer-loras`` is miles'
shared-outer layout: the factors on the hidden-size side are one per layer, shared by the
layer's experts (``linear_fc1``'s ``A``, ``linear_fc2``'s ``B``), and the factors on the expert's
own intermediate side stay per expert, so expert ``e`` gets ``W1_e + s B1_e A1`` and
``W2_e + s B2 A2_e``.

The adapters sit on Megatron's fused layers, as miles' (and Megatron-Bridge's) standard
``lora`` type has them: ``q_proj``, ``k_proj`` and ``v_proj`` name the one ``linear_qkv``
(an adapter on the fused QKV output), ``gate_proj`` and ``up_proj`` the one ``linear_fc1``.
:data:`MEGATRON_MODULE` is the one table of those names.

Example: ``LoraOptions(rank=8, alpha=16, target_modules=("q_proj", "v_proj"))
.megatron_modules`` is ``("linear_qkv",)`` and ``.scaling`` is 2.0;
``LoraOptions(rank=8, target_modules=("down_proj",)).expert_modules`` is ``("linear_fc2",)``.
"""

import attrs

from vime_pure.errors import VimeError, field_error

# HF module name -> the Megatron layer that holds it (standard LoRA: fused QKV and gate/up)
MEGATRON_MODULE: dict[str, str] = {
    "q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv",
    "o_proj": "linear_proj", "gate_proj": "linear_fc1", "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}
MEGATRON_LAYERS: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
EXPERT_LAYERS: tuple[str, ...] = ("linear_fc1", "linear_fc2")  # what a routed expert holds
ALL_LINEAR = "all-linear"
LORA_TYPES: tuple[str, ...] = ("lora",)


class LoraOptionsError(VimeError):
    """A LoRA setting that names no layer, or that Megatron's layers cannot take."""


def split_names(text: str | None) -> tuple[str, ...]:
    """``"q_proj, v_proj"`` -> ``("q_proj", "v_proj")`` (miles' comma-separated form)."""
    return tuple(n.strip() for n in (text or "").split(",") if n.strip())


def _megatron_layer(name: str, flag: str) -> str:
    if name in MEGATRON_LAYERS:
        return name
    if name in MEGATRON_MODULE:
        return MEGATRON_MODULE[name]
    raise field_error(LoraOptionsError, flag, name, "is not a linear layer vime adapts",
                      f"use {ALL_LINEAR!r} or some of {sorted(MEGATRON_MODULE)} (HF names) or "
                      f"{list(MEGATRON_LAYERS)} (Megatron names)")


@attrs.frozen(kw_only=True)
class LoraOptions:
    """The adapters of a LoRA run (module docstring); built only when ``--lora-rank`` > 0."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    exclude_modules: tuple[str, ...] = ()
    experts_shared_outer: bool = False  # MoE experts: hidden-side factors shared (docstring)

    def __attrs_post_init__(self) -> None:
        if self.rank < 1:
            raise field_error(LoraOptionsError, "--lora-rank", self.rank, "must be >= 1 for "
                              "adapters", "pass e.g. --lora-rank 16 (0 turns LoRA off)")
        if not self.alpha > 0:
            raise field_error(LoraOptionsError, "--lora-alpha", self.alpha, "must be > 0",
                              "pass e.g. --lora-alpha 32 (the update is scaled by alpha/rank)")
        if self.dropout != 0.0:
            raise field_error(LoraOptionsError, "--lora-dropout", self.dropout,
                              "must be 0: the policy's log-probs are recomputed in the "
                              "training forward, and a random mask there breaks the ratio",
                              "drop it (miles' RL scripts pass 0.0)")
        if not self.megatron_modules:
            raise field_error(LoraOptionsError, "--exclude-modules",
                              ",".join(self.exclude_modules), "leaves no layer to adapt",
                              "exclude fewer modules")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def megatron_modules(self) -> tuple[str, ...]:
        """The Megatron layers adapted, in the model's order."""
        names = list(MEGATRON_LAYERS) if ALL_LINEAR in self.target_modules else [
            _megatron_layer(n, "--target-modules") for n in self.target_modules]
        excluded = {_megatron_layer(n, "--exclude-modules") for n in self.exclude_modules}
        hf_excluded = set(self.exclude_modules) & set(MEGATRON_MODULE)
        # An HF name excluded from a fused layer whose other names stay targeted keeps the
        # layer (one adapter covers all of it); a fused layer goes when all its names go.
        for layer in set(excluded):
            hf_names = {n for n, m in MEGATRON_MODULE.items() if m == layer}
            if layer not in self.exclude_modules and not hf_names <= hf_excluded:
                excluded.discard(layer)
        return tuple(m for m in MEGATRON_LAYERS if m in names and m not in excluded)

    @property
    def expert_modules(self) -> tuple[str, ...]:
        """The adapted layers a MoE layer's routed experts have (``linear_fc1``,
        ``linear_fc2``)."""
        return tuple(m for m in self.megatron_modules if m in EXPERT_LAYERS)

    @property
    def expert_layout(self) -> str:
        """miles' name of the experts' adapter layout, for the launch log."""
        return "shared-outer" if self.experts_shared_outer else "per-expert"
