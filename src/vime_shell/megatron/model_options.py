"""Model-construction settings the trainer passes to Megatron's ``TransformerConfig``:
activation recompute and the MoE router / dispatcher knobs (torch-free, checked at launch).

Every field is named and means what Megatron's (and slime's) flag of the same name does;
``None`` keeps what the bridge reads from the HF config (``--moe-router-topk`` defaults to the
checkpoint's ``num_experts_per_tok``). :meth:`ModelOptions.transformer_fields` is the one place
these flags become ``TransformerConfig`` fields.

The choice lists below are the only ones (``vime train --help`` shows them):

- ``--recompute-granularity full`` recomputes whole layers (``--recompute-method uniform``:
  chunks of ``--recompute-num-layers`` layers; ``block``: the first ``--recompute-num-layers``
  layers of each pipeline stage); ``selective`` recomputes ``--recompute-modules`` (default
  ``core_attn``) and takes no method or layer count.
- ``--moe-token-dispatcher-type``: ``alltoall`` (the default, runs on CPU and GPU) or ``flex``
  (DeepEP, GPU-only). Megatron's ``allgather`` is not offered: it refuses variable sequence
  lengths, which vime's packed micro-batches need.

Example: ``ModelOptions(recompute_granularity="full", recompute_method="uniform",
recompute_num_layers=1).transformer_fields()`` is ``{"recompute_granularity": "full",
"recompute_method": "uniform", "recompute_num_layers": 1}``.
"""

import attrs

from vime_pure.errors import VimeError, field_error

RECOMPUTE_GRANULARITIES: tuple[str, ...] = ("full", "selective")
RECOMPUTE_METHODS: tuple[str, ...] = ("uniform", "block")
RECOMPUTE_MODULES: tuple[str, ...] = ("core_attn", "mlp", "layernorm", "moe", "moe_act",
                                      "shared_experts")
MOE_DISPATCHERS: tuple[str, ...] = ("alltoall", "flex")
MOE_LOAD_BALANCING: tuple[str, ...] = ("none", "aux_loss", "seq_aux_loss", "sinkhorn")
MOE_ROUTER_DTYPES: tuple[str, ...] = ("fp32", "fp64")


class ModelOptionsError(VimeError):
    """A recompute or MoE setting Megatron would reject, or that contradicts another."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@attrs.frozen(kw_only=True)
class ModelOptions:
    """Recompute and MoE settings (module docstring); defaults change nothing."""

    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: tuple[str, ...] | None = None
    moe_router_topk: int | None = None
    moe_aux_loss_coeff: float | None = None
    moe_z_loss_coeff: float | None = None
    moe_router_load_balancing_type: str | None = None
    moe_token_dispatcher_type: str | None = None
    moe_router_dtype: str | None = None
    moe_grouped_gemm: bool | None = None
    moe_permute_fusion: bool | None = None
    moe_enable_routing_replay: bool = False
    # --enable-mtp-training: the MTP loss weight (--mtp-loss-scaling-factor); None: the
    # checkpoint's MTP layers are not built (vime_shell.megatron.mtp)
    mtp_loss_scaling_factor: float | None = None

    def __attrs_post_init__(self) -> None:
        for name, choices in (("recompute_granularity", RECOMPUTE_GRANULARITIES),
                              ("recompute_method", RECOMPUTE_METHODS),
                              ("moe_token_dispatcher_type", MOE_DISPATCHERS),
                              ("moe_router_load_balancing_type", MOE_LOAD_BALANCING),
                              ("moe_router_dtype", MOE_ROUTER_DTYPES)):
            value = getattr(self, name)
            if value is not None and value not in choices:
                raise field_error(ModelOptionsError, _flag(name), value, "is not a valid choice",
                                  f"use one of {list(choices)}")
        for module in self.recompute_modules or ():
            if module not in RECOMPUTE_MODULES:
                raise field_error(ModelOptionsError, "--recompute-modules", module,
                                  "is not a recomputable module",
                                  f"use some of {list(RECOMPUTE_MODULES)}")
        self._check_recompute()
        for name in ("moe_router_topk", "recompute_num_layers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise field_error(ModelOptionsError, _flag(name), value, "must be >= 1",
                                  "pass a positive number")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1e6:
                raise field_error(ModelOptionsError, _flag(name), value, "must be >= 0",
                                  "use 0 to turn it off, e.g. 1e-3")

    def _check_recompute(self) -> None:
        granularity = self.recompute_granularity
        if granularity is None:
            for name in ("recompute_method", "recompute_num_layers", "recompute_modules"):
                if getattr(self, name) is not None:
                    raise field_error(ModelOptionsError, _flag(name), getattr(self, name),
                                      "has no effect without --recompute-granularity",
                                      "pass --recompute-granularity full or selective")
        elif granularity == "full":
            if self.recompute_method is None or self.recompute_num_layers is None:
                raise field_error(ModelOptionsError, "--recompute-granularity", "full",
                                  "needs --recompute-method and --recompute-num-layers",
                                  "pass e.g. --recompute-method uniform --recompute-num-layers 1")
            if self.recompute_modules is not None:
                raise field_error(ModelOptionsError, "--recompute-modules",
                                  list(self.recompute_modules), "applies to selective recompute",
                                  "drop it, or pass --recompute-granularity selective")
        elif self.recompute_method is not None or self.recompute_num_layers is not None:
            raise field_error(ModelOptionsError, "--recompute-granularity", "selective",
                              "takes no --recompute-method / --recompute-num-layers",
                              "drop them, or use --recompute-granularity full")
        if self.moe_enable_routing_replay and self.moe_router_load_balancing_type == "sinkhorn":
            raise field_error(ModelOptionsError, "--moe-router-load-balancing-type", "sinkhorn",
                              "routes without top-k, so --use-rollout-routing-replay cannot "
                              "replay it", "use aux_loss, seq_aux_loss or none")
        if "moe_act" in (self.recompute_modules or ()) and not self.moe_grouped_gemm:
            raise field_error(ModelOptionsError, "--recompute-modules", "moe_act",
                              "needs --moe-grouped-gemm (a GPU-only expert kernel)",
                              "recompute 'moe' instead")

    @property
    def recomputes(self) -> bool:
        return self.recompute_granularity is not None

    def transformer_fields(self) -> dict[str, object]:
        """The ``TransformerConfig`` fields these settings set (unset ones are left out)."""
        out: dict[str, object] = {}
        for f in attrs.fields(type(self)):
            value = getattr(self, f.name)
            if value is not None and f.name not in ("moe_enable_routing_replay",
                                                    "mtp_loss_scaling_factor"):
                out[f.name] = list(value) if f.name == "recompute_modules" else value
        if self.moe_enable_routing_replay:
            out["moe_enable_routing_replay"] = True
            out["moe_router_fusion"] = False  # TE's fused top-k never consults RouterReplay
        return out
