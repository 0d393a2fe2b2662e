"""LoRA (section ``lora``): miles' flags, checked into a ``LoraOptions``
(``vime_shell.megatron.lora_options``, the one place for their rules and name table).

``--lora-rank 0`` (the default) trains every weight, as before. With a rank, the base
weights are frozen, the adapters train, and the engine and ``--save-hf`` get the merged
weights (``vime_shell.megatron.lora``).

Example: ``LoraArgs(lora_rank=8)`` raises ``--target-modules=None: is required with
--lora-rank ...``, as miles does.
"""

import attrs

from vime_pure.errors import VimeError, field_error
from vime_shell.megatron.lora_options import ALL_LINEAR, LORA_TYPES, LoraOptions, split_names
from vime_shell.settings.common import ConfigError, Record, setting


def _lora(default, help, choices=None):
    return setting(default, help, "lora", choices)


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class LoraArgs(Record):
    """LoRA adapters on the policy (miles' flags)."""

    lora_rank: int = _lora(0, "LoRA rank; 0: off (every weight trains)")
    lora_alpha: float = _lora(16.0, "LoRA alpha: the update is scaled by alpha/rank")
    lora_dropout: float = _lora(0.0, "dropout on the adapters' input; must be 0 (the RL "
                                "ratio needs a deterministic forward)")
    lora_type: str = _lora("lora", "adapters on Megatron's fused layers (q/k/v_proj share "
                           "linear_qkv's, gate/up_proj linear_fc1's); miles' canonical_lora "
                           "(split q/k/v) is not offered", LORA_TYPES)
    target_modules: str | None = _lora(None, f"{ALL_LINEAR!r} or comma-separated HF "
                                       "(q_proj, ..., down_proj) or Megatron (linear_qkv, "
                                       "linear_proj, linear_fc1, linear_fc2) names")
    exclude_modules: str | None = _lora(None, "comma-separated names left out of "
                                        "--target-modules")
    experts_shared_outer_loras: bool = _lora(
        False, "MoE experts (gate/up/down_proj targets): miles' shared-outer layout, "
        "linear_fc1's A and linear_fc2's B one per layer, shared by its experts (the other "
        "factor per expert); default: per-expert A and B")
    lora_base_cpu_backup: bool = _lora(
        False, "accepted, a no-op: miles keeps a host copy of the engine's frozen base so it "
        "re-sends only the adapter; vime's engine holds no separate base (every sync sends the "
        "merged W + alpha/rank x B A), so its weights are the same with or without it")

    def lora_options(self) -> LoraOptions | None:
        """The adapters, or None when ``--lora-rank`` is 0."""
        if self.lora_rank == 0:
            return None
        try:
            return LoraOptions(rank=self.lora_rank, alpha=self.lora_alpha,
                               dropout=self.lora_dropout,
                               target_modules=split_names(self.target_modules),
                               exclude_modules=split_names(self.exclude_modules),
                               experts_shared_outer=self.experts_shared_outer_loras)
        except VimeError as exc:
            raise ConfigError(str(exc)) from None

    def _check(self) -> None:
        if self.lora_rank < 0:
            raise field_error(ConfigError, "--lora-rank", self.lora_rank, "must be >= 0",
                              "pass 0 (off) or a rank such as 16")
        if self.lora_rank > 0 and not split_names(self.target_modules):
            raise field_error(ConfigError, "--target-modules", self.target_modules,
                              "is required with --lora-rank", f"pass {ALL_LINEAR!r} or "
                              "names such as q_proj,v_proj")
        if self.experts_shared_outer_loras and self.lora_rank == 0:
            raise field_error(ConfigError, "--experts-shared-outer-loras", True,
                              "lays out LoRA adapters on MoE experts, and --lora-rank is 0 "
                              "(no adapters)", "pass --lora-rank (with gate_proj,up_proj,"
                              "down_proj in --target-modules), or drop the flag")
        self.lora_options()  # the rules on the names, rank, alpha and dropout
