"""GLM-4 (dense, ``model_type`` ``glm4``; slime's ``--spec slime_plugins.models.glm4
get_glm_spec``): Megatron's GPT layer with GLM-4's two extra norms, and the HF mapping.

No kept library maps it (mbridge 0.15 has GLM-4 MoE only), so vime writes the few lines that
differ from Qwen2, whose bridge it extends:

- **Post-norms**: GLM-4 normalises the attention output and the MLP output before each
  residual add (``post_self_attn_layernorm``, ``post_mlp_layernorm``). Both outputs leave
  through a row-parallel projection (``linear_proj``, ``linear_fc2``), so that projection
  carries the norm (:func:`with_post_norms`), and Megatron's own ``SelfAttention``, ``MLP``
  and residual adds stay as they are; its ``post_norm.weight`` maps to the HF names.
- **RoPE**: interleaved pairs (``rotary_interleaved``) on the first ``partial_rotary_factor``
  of each head (``rotary_percent``, which ``bridge.make_bridge`` sets from it for every
  bridge), as transformers' ``Glm4`` applies it.
- **The fused gate/up projection**: HF's ``mlp.gate_up_proj`` is Megatron's ``linear_fc1``
  row for row (gate rows, then up rows), so it maps whole; mbridge splits it over TP the way
  it splits Qwen2's concatenated gate and up.

Example: ``Glm4(hf_config, dtype=torch.float32)`` is the bridge of a ``glm4`` checkpoint, and a
block spec passed through :func:`with_post_norms` builds these layers.
"""

import copy

from mbridge.models.qwen2 import Qwen2Bridge
from megatron.core.extensions.transformer_engine import TENorm
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import build_module

# the post-norms' Megatron names -> HF names
GLM4_NORM_NAMES = {
    "self_attention.linear_proj.post_norm.weight":
        "model.layers.{n}.post_self_attn_layernorm.weight",
    "mlp.linear_fc2.post_norm.weight": "model.layers.{n}.post_mlp_layernorm.weight",
}
_GATE_UP = "model.layers.{layer_number}.mlp.gate_up_proj.weight"


class _PostNormed:
    """A row-parallel output projection whose output (all-reduced: the full hidden state)
    goes through ``post_norm``, GLM-4's norm before the residual add."""

    post_norm_class: type | None = None  # set per spec by with_post_norms

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_norm = build_module(self.post_norm_class, config=config,
                                      hidden_size=output_size, eps=config.layernorm_epsilon)

    def forward(self, *args, **kwargs):
        output, bias = super().forward(*args, **kwargs)
        return self.post_norm(output if bias is None else output + bias), None


def with_post_norms(spec):
    """``spec`` (a decoder block spec) with GLM-4's post-norms on the attention's and the MLP's
    output projections (``linear_proj``, ``linear_fc2``, whatever their class: TE's or
    Megatron's). The norm class is the layer's own input norm, or TransformerEngine's
    ``TENorm`` where the TE spec fuses that norm into the QKV projection (its input norm is
    then an identity, which would silently drop the post-norms)."""
    spec = copy.deepcopy(spec)
    for layer in spec.layer_specs:
        norm = layer.submodules.input_layernorm
        if norm is IdentityOp:
            norm = TENorm
        for owner, name in ((layer.submodules.self_attention, "linear_proj"),
                            (layer.submodules.mlp, "linear_fc2")):
            linear = getattr(owner.submodules, name)
            if issubclass(linear, _PostNormed):  # layers may share one submodules record
                continue
            setattr(owner.submodules, name, type(f"PostNormed{linear.__name__}",
                                                 (_PostNormed, linear),
                                                 {"post_norm_class": norm}))
    return spec


class Glm4(Qwen2Bridge):
    """mbridge's Qwen2 bridge with GLM-4's RoPE, fused gate/up and no q/k norms."""

    _MLP_MAPPING = {**Qwen2Bridge._MLP_MAPPING, "mlp.linear_fc1.weight": [_GATE_UP]}
    EXTRA_NORM_NAMES = GLM4_NORM_NAMES  # the post-norms (bridge.make_bridge)

    @staticmethod
    def adapt_layer_spec(spec, *, transformer_engine: bool, vp_stage=None):
        """The block spec with GLM-4's post-norms (:func:`with_post_norms`, either spec)."""
        return with_post_norms(spec)

    def _build_config(self):
        hf = self.hf_config
        return self._build_base_config(
            add_qkv_bias=bool(getattr(hf, "attention_bias", True)), qk_layernorm=False,
            rotary_interleaved=True, kv_channels=getattr(hf, "head_dim", None))


    def _weight_to_hf_format(self, mcore_weights_name, mcore_weights):
        if "linear_fc1.weight" in mcore_weights_name:
            return self._weight_name_mapping_mcore_to_hf(mcore_weights_name), [mcore_weights]
        return super()._weight_to_hf_format(mcore_weights_name, mcore_weights)

    def _weight_to_mcore_format(self, mcore_weights_name, hf_weights):
        if "linear_fc1.weight" in mcore_weights_name:
            return hf_weights[0]
        return super()._weight_to_mcore_format(mcore_weights_name, hf_weights)
