"""GLM-5 (``model_type`` ``glm_moe_dsa``; GLM-5.1 and 5.2 share it): DeepSeek-V3's model with
DeepSeek sparse attention, slime's ``--spec slime_plugins.models.glm5.glm5 get_glm5_spec``.

Everything but the attention's selection is GLM-4.7-Flash's, which vime trains as DeepSeek-V3
(:mod:`vime_shell.megatron.mla_bridge`: multi-latent attention, dense layers first, a sigmoid
router with an expert bias, a shared expert), under the same weight names. What this bridge
adds, a mapping of vime's own (mbridge 0.15 has no GLM-5 bridge):

1. the layer spec: MLA's core attention is :class:`~vime_shell.megatron.sparse_attention.
   SparseCoreAttention` on every layer (the local spec and TransformerEngine's alike; TE has
   no sparse attention). It needs MLA's normalised low-rank query, so under TransformerEngine
   the query norm is built apart from the up-projection, where TE's spec would fuse it (under
   the same HF name ``q_a_layernorm``, ``mla_bridge.MLA_LOCAL_NORM_NAMES``).
2. Megatron's MLA hands a core attention the layer input and that query only when
   ``experimental_attention_variant`` is ``"dsa"``; the field is set after the config's
   checks, which assert preconditions of megatron-core's own ``DSAttention`` (no context
   parallelism), not of vime's layer.
3. the indexer's weights, ``model.layers.{n}.self_attn.indexer.{wq_b,wk,k_norm,
   weights_proj}``, one copy on every TP rank, on the layers whose ``indexer_types`` entry
   is ``"full"`` (a ``"shared"`` layer has none, in the checkpoint and in the model).

Example: ``make_bridge(glm5_dir, platform)`` builds it for a ``glm_moe_dsa`` checkpoint; the
logits equal transformers' ``GlmMoeDsaForCausalLM`` (``tests/shell/test_glm5.py``).
"""

from megatron.core.transformer.spec_utils import ModuleSpec

from vime_shell.megatron.mla_bridge import MLA_LOCAL_NORM_NAMES, DeepseekV3
from vime_shell.megatron.sparse_attention import (SelectionStore, SparseCoreAttention,
                                                  in_flight)
from vime_shell.models.hf_config import sparse_indexer_types

try:  # TransformerEngine's layers, for its spec (adjustment 1); absent on CPU
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm
except ImportError:  # pragma: no cover - megatron-core ships the module with or without TE
    TEColumnParallelLinear = TENorm = None

_INDEXER = "self_attention.core_attention.indexer."
INDEXER_NAMES = {f"{_INDEXER}{w}": f"model.layers.{{n}}.self_attn.indexer.{w}"
                 for w in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias",
                           "weights_proj.weight")}


class GlmMoeDsa(DeepseekV3):
    """DeepSeek-V3's adjusted bridge with GLM-5's sparse attention (adjustments 1-3)."""

    EXTRA_NORM_NAMES = {**MLA_LOCAL_NORM_NAMES, **INDEXER_NAMES}  # 1:1 names (bridge.py)

    def adapt_layer_spec(self, spec, *, transformer_engine: bool, vp_stage=None):
        store = SelectionStore(in_flight())  # one per model chunk: its full layers' selections
        types = sparse_indexer_types(self.hf_config.to_dict(), self.hf_dir / "config.json")
        core = ModuleSpec(module=SparseCoreAttention,
                          params={"hf_config": self.hf_config, "indexer_types": types,
                                  "store": store})
        for layer in spec.layer_specs:
            attention = layer.submodules.self_attention.submodules
            attention.core_attention = core
            if transformer_engine:
                attention.linear_q_up_proj = TEColumnParallelLinear
                attention.q_layernorm = TENorm
        return spec

    def _build_config(self):
        config = super()._build_config()
        config.experimental_attention_variant = "dsa"  # adjustment 2
        return config
