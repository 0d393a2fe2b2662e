"""Megatron's MoE-router and RoPE-scaling architecture flags (section ``architecture``), as
slime's ``scripts/models/*.sh`` pass them for Qwen3-MoE, GLM-4.x, DeepSeek-V3 and Kimi-K2.

Like the other architecture flags (``vime_shell.settings.megatron_args``) they are *checked*
against the HF config, never used to build the model: :func:`moe_hf_values` says what each one
means in HF terms, and ``check_architecture`` compares. A key the HF config does not hold is
not checked (the bridge builds the router from the config either way).

``--moe-layer-freq`` is Megatron's layer pattern: an int ``k`` (every k-th layer is MoE), or a
list written as Python, ``[1,1,1]`` or ``([0]*3+[1]*58)``; it is read without evaluating code
(:func:`moe_layer_pattern`). Example: ``moe_layer_pattern("[0]*1+[1]*3", 4) == [0, 1, 1, 1]``;
against a Qwen3-MoE config (every layer MoE) it must be all ones.
"""

import ast
from typing import Any

import attrs

from vime_pure.errors import VimeError, field_error
from vime_shell.models.hf_config import EXPERT_KEYS, SIGMOID_ROUTERS
from vime_shell.settings.common import ConfigError, Record, setting

SECTION = "architecture"
SCORE_FUNCTIONS: tuple[str, ...] = ("softmax", "sigmoid")
# model types whose router is a plain softmax top-k without expert bias (no HF key says so)
_SOFTMAX_ROUTERS = ("qwen2_moe", "qwen3_moe", "mixtral", "qwen3_next", "qwen3_5_moe_text",
                    "gpt_oss")
_SHARED_GATE = {"qwen2_moe": True, "qwen3_next": True, "qwen3_5_moe_text": True,
                "qwen3_moe": False, "mixtral": False, "gpt_oss": False}
# softmax routers whose top-k softmax no norm_topk_prob states: gpt-oss's is over the k picked
_PRE_SOFTMAX = {"gpt_oss": False}


class LayerPatternError(VimeError):
    """A ``--moe-layer-freq`` that is not an int or a list of 0/1 written as Python."""


def _arch(help: str, choices: tuple | None = None) -> Any:
    return setting(None, f"{help}; checked against the HF config", SECTION, choices)


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class MoEArchArgs(Record):
    """MoE routing and RoPE scaling as Megatron names them (module docstring)."""

    moe_layer_freq: str | None = _arch("which layers are MoE: k (every k-th) or a 0/1 list "
                                       "such as '[0]*3+[1]*58'")
    moe_router_score_function: str | None = _arch("router scores", SCORE_FUNCTIONS)
    moe_router_pre_softmax: bool | None = _arch("softmax over all experts before top-k "
                                                "(HF: not norm_topk_prob)")
    moe_router_topk_scaling_factor: float | None = _arch("scale of the routed weights (HF "
                                                         "routed_scaling_factor)")
    moe_router_num_groups: int | None = _arch("expert groups of group-limited routing (HF "
                                              "n_group)")
    moe_router_group_topk: int | None = _arch("groups each token may use (HF topk_group)")
    moe_router_enable_expert_bias: bool | None = _arch("aux-loss-free expert bias (HF "
                                                       "topk_method noaux_tc)")
    moe_shared_expert_gate: bool | None = _arch("a sigmoid gate on the shared expert")
    rotary_scaling_factor: float | None = _arch("RoPE scaling factor (HF rope_scaling.factor)")
    mscale: float | None = _arch("YaRN mscale")
    mscale_all_dim: float | None = _arch("YaRN mscale_all_dim")
    original_max_position_embeddings: int | None = _arch("context length before RoPE scaling")
    beta_fast: float | None = _arch("YaRN beta_fast")
    beta_slow: float | None = _arch("YaRN beta_slow")
    rope_type: str | None = _arch("RoPE scaling kind (HF rope_scaling.rope_type)")

    def _check(self) -> None:
        if self.moe_layer_freq is not None:
            try:
                moe_layer_pattern(self.moe_layer_freq, None)
            except LayerPatternError as exc:
                raise ConfigError(str(exc)) from None


def _pattern_node(node: ast.AST) -> list[int] | int:
    """A literal int, a list of ints, or ``+`` / ``*`` of those (nothing else is read)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        items = [_pattern_node(e) for e in node.elts]
        if all(isinstance(i, int) for i in items):
            return items  # type: ignore[return-value]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern_node(node.left), _pattern_node(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, int) \
                and 0 <= right <= 100_000:
            return left * right
    raise ValueError("not a list pattern")


def moe_layer_pattern(text: str, num_layers: int | None) -> list[int]:
    """``--moe-layer-freq`` as one 0/1 entry per layer (module docstring); an int needs
    ``num_layers`` to expand (without it, ``[1]`` stands for 'every layer')."""
    try:
        value = _pattern_node(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        value = None
    if isinstance(value, int) and value >= 1:
        return [int(i % value == 0) for i in range(num_layers or 1)]
    if isinstance(value, list) and value and set(value) <= {0, 1}:
        return value
    raise field_error(LayerPatternError, "--moe-layer-freq", text,
                      "is not an int >= 1 or a list of 0/1 per layer",
                      "pass e.g. 1 (every layer MoE) or '[0]*1+[1]*47'")


def hf_num_experts(hf: dict[str, Any]) -> int | None:
    """Routed experts in a config.json (Qwen's ``num_experts``; transformers 5 writes Qwen-MoE
    and Mixtral as ``num_local_experts``; DeepSeek's ``n_routed_experts``); None: dense."""
    return next((hf[k] for k in EXPERT_KEYS if hf.get(k)), None)


def _hf_layer_pattern(hf: dict[str, Any]) -> list[int] | None:
    layers = hf.get("num_hidden_layers")
    if not layers or hf_num_experts(hf) is None:
        return None
    if "first_k_dense_replace" in hf:  # DeepSeek-V3, GLM-4.x MoE
        k = int(hf["first_k_dense_replace"])
        return [0] * k + [1] * (layers - k)
    if isinstance(hf.get("mlp_layer_types"), list):  # GLM-4.7-Flash: "dense" / "sparse"
        return [int(t == "sparse") for t in hf["mlp_layer_types"]]
    dense = set(hf.get("mlp_only_layers") or ())
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    return [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]


def moe_hf_values(hf: dict[str, Any]) -> dict[str, Any]:
    """What each flag of :class:`MoEArchArgs` means in this HF config (None: not checked)."""
    kind = str(hf.get("model_type"))
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    score = hf.get("scoring_func") or ("softmax" if kind in _SOFTMAX_ROUTERS else
                                       "sigmoid" if kind in SIGMOID_ROUTERS else None)
    bias = hf.get("topk_method") == "noaux_tc" if "topk_method" in hf else \
        bool(hf["use_routing_bias"]) if "use_routing_bias" in hf else (  # MiniMax-M2's key
            False if kind in _SOFTMAX_ROUTERS else None)
    return {
        "moe_layer_freq": _hf_layer_pattern(hf),
        "moe_router_score_function": score,
        # Megatron reads it for softmax routers only (sigmoid top-k is always renormalised),
        # and slime's DeepSeek / Moonlight scripts pass it beside norm_topk_prob true
        "moe_router_pre_softmax": (not bool(hf["norm_topk_prob"])
                                   if "norm_topk_prob" in hf and score != "sigmoid" else
                                   _PRE_SOFTMAX.get(kind)),
        "moe_router_topk_scaling_factor": hf.get("routed_scaling_factor"),
        "moe_router_num_groups": hf.get("n_group"),
        "moe_router_group_topk": hf.get("topk_group"),
        "moe_router_enable_expert_bias": bias,
        "moe_shared_expert_gate": _SHARED_GATE.get(kind),
        "rotary_scaling_factor": rope.get("factor"),
        "mscale": rope.get("mscale"), "mscale_all_dim": rope.get("mscale_all_dim"),
        "original_max_position_embeddings": rope.get("original_max_position_embeddings"),
        "beta_fast": rope.get("beta_fast"), "beta_slow": rope.get("beta_slow"),
        "rope_type": rope.get("rope_type", rope.get("type")),
    }


def given_values(cfg: Any, num_layers: int | None) -> dict[str, Any]:
    """The flags given, as :func:`moe_hf_values` spells them, the layer pattern expanded over
    ``num_layers`` (``--moe-router-pre-softmax`` absent is False in Megatron, but an absent
    flag is never checked: a script need not spell every default)."""
    out = {f.name: getattr(cfg, f.name) for f in attrs.fields(MoEArchArgs)
           if getattr(cfg, f.name) is not None}
    if "moe_layer_freq" in out:
        out["moe_layer_freq"] = moe_layer_pattern(out["moe_layer_freq"], num_layers)
    return out
