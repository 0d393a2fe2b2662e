"""MiniMax-M2 (``model_type`` ``minimax_m2``; slime's ``--spec slime_plugins.models.minimax_m2
get_minimax_m2_layer_spec``): Megatron's GPT layers with MiniMax-M2's q/k norms, and the HF
mapping.

No kept library maps it (mbridge 0.15 has Mixtral, whose names it shares), so vime writes the
lines that differ from Mixtral, whose bridge it extends:

- **q/k norms over all heads**: transformers normalises the whole ``q_proj`` (and ``k_proj``)
  output, every head together, where Megatron's ``q_layernorm`` normalises each head.
  :class:`AllHeadsQNorm` / :class:`AllHeadsKNorm` take Megatron's slots: the mean square is
  over all heads, the partial sums all-reduced over TP (a scalar per token, not the
  activations), and the weight is split over TP with the heads.
- **Routing**: a sigmoid router with an expert bias (``e_score_correction_bias``) that picks
  the top-k and renormalises their scores, Megatron's sigmoid router with
  ``moe_router_enable_expert_bias``; the bias is the checkpoint's, never updated (as for
  DeepSeek-V3), and there is no shared expert.
- **RoPE** on the first ``partial_rotary_factor`` of each head (the release's ``rotary_dim``,
  which transformers' config turns into it).

Example: ``MiniMaxM2(hf_config, dtype=torch.float32)`` is the bridge of a ``minimax_m2``
checkpoint (``bridge.make_bridge`` picks it by ``model_type``).
"""

import copy

import torch
import torch.distributed.nn.functional as dist_nn
from mbridge.models.mixtral import MixtralBridge
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

from vime_shell.models.hf_config import ModelLoadError

_BIAS = "model.layers.{layer_number}.block_sparse_moe.e_score_correction_bias"


class _AllHeadsNorm(torch.nn.Module):
    """RMSNorm over all heads of a projection, on Megatron's ``[s, b, heads_here, head_dim]``
    (module docstring); which heads: the config field ``HEADS`` names their count."""

    HEADS = ""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        tp = config.tensor_model_parallel_size
        heads = getattr(config, self.HEADS)
        if heads % tp:
            raise ModelLoadError(f"{self.HEADS}={heads} is not a multiple of "
                                 f"--tensor-model-parallel-size {tp}: MiniMax-M2's q/k norms "
                                 "need whole heads on every rank. Fix: use a TP size that "
                                 "divides it.")
        self.eps, self.width = eps, heads * hidden_size
        self.weight = torch.nn.Parameter(torch.ones(heads // tp * hidden_size,
                                                    dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        square = h.pow(2).sum(dim=(-2, -1), keepdim=True)
        if mpu.get_tensor_model_parallel_world_size() > 1:  # the other heads' partial sums
            square = dist_nn.all_reduce(square, group=mpu.get_tensor_model_parallel_group())
        h = h * torch.rsqrt(square / self.width + self.eps)
        return self.weight.view(x.shape[-2:]) * h.to(x.dtype)


class AllHeadsQNorm(_AllHeadsNorm):
    HEADS = "num_attention_heads"


class AllHeadsKNorm(_AllHeadsNorm):
    HEADS = "num_query_groups"


def with_all_heads_norms(spec):
    """``spec`` (a decoder block spec) with MiniMax-M2's q/k norms in every layer."""
    spec = copy.deepcopy(spec)
    for layer in spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        attention.q_layernorm, attention.k_layernorm = AllHeadsQNorm, AllHeadsKNorm
    return spec


class MiniMaxM2(MixtralBridge):
    """mbridge's Mixtral bridge with MiniMax-M2's norms, router and RoPE."""

    _MLP_MAPPING = {"mlp.router.expert_bias": [_BIAS], **MixtralBridge._MLP_MAPPING}

    @staticmethod
    def adapt_layer_spec(spec, *, transformer_engine: bool, vp_stage=None):
        return with_all_heads_norms(spec)

    def _build_config(self):
        hf = self.hf_config
        return self._build_base_config(
            num_moe_experts=hf.num_local_experts, moe_router_topk=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.intermediate_size, moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0,
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_router_dtype="fp32", qk_layernorm=True, kv_channels=hf.head_dim)

