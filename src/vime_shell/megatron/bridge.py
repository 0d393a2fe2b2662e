"""Megatron ``GPTModel`` from a Hugging Face model directory, and export back to HF tensors.

Purpose: load an HF checkpoint (Qwen2/Qwen3 and their MoE, Llama, GLM-4.5 MoE; DeepSeek-V3,
Kimi-K2 and GLM-4.7-Flash, :mod:`vime_shell.megatron.mla_bridge`; GLM-5,
:mod:`vime_shell.megatron.glm5_bridge`; GLM-4, :mod:`vime_shell.megatron.glm4_bridge`;
gpt-oss, :mod:`vime_shell.megatron.gpt_oss_bridge`) into
Megatron-core model chunks (one per virtual pipeline stage on this rank) with ``mbridge``, and
stream the trained weights back out under their HF names (weight sync to the rollout engine,
checkpoint export).

mbridge 0.15 assumes TransformerEngine and an older transformers. :func:`make_bridge` applies
the five adjustments it needs, all here and nowhere else (plus RoPE scaling,
:mod:`vime_shell.megatron.rope`, and the MoE adjustments, :mod:`vime_shell.megatron.moe_bridge`):

1. layer spec: Megatron's decoder block spec with ``use_transformer_engine`` from the platform
   (the local spec on CPU), RMSNorm and ``qk_layernorm`` as configured;
2. norm names: the local spec's ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight`` map to
   HF ``input_layernorm`` / ``post_attention_layernorm``;
3. transformers 5 moved ``rope_theta`` into ``rope_parameters``: it is copied back;
4. dtype: the platform's (fp32 on CPU; mbridge defaults to bf16, which costs ~2e-3 logit parity);
5. sequence parallel and fusions off on CPU (mbridge turns SP on whenever TP > 1).

Invariants (tested in ``tests/shell/test_conversion.py``): HF -> Megatron -> HF is bit-exact at
TP1, TP2 and PP2; Megatron logits equal transformers' to 1e-5 in fp32.

Example: ``bridge = make_bridge(hf_dir, platform); chunks = build_model_chunks(bridge,
platform, layout)`` gives ``layout.vpp`` ``GPTModel`` chunks holding the checkpoint's weights.
"""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from mbridge import AutoBridge
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

from vime_pure.errors import one_line
from vime_shell.models.auto_config import auto_config
from vime_shell.models.hf_config import MTP_MODEL_TYPES, ModelLoadError
from vime_shell.megatron import mtp
from vime_shell.megatron.layout import TrainLayout
from vime_shell.megatron.glm4_bridge import Glm4
from vime_shell.megatron.glm5_bridge import GlmMoeDsa
from vime_shell.megatron.gpt_oss_bridge import GptOss
from vime_shell.megatron.minimax_m2_bridge import MiniMaxM2
from vime_shell.megatron.mla_bridge import DeepseekV3, is_mla
from vime_shell.megatron.qwen3_5_bridge import Qwen3_5, Qwen3_5Moe, Qwen3Next
from vime_shell.megatron.model_options import ModelOptions
from vime_shell.megatron.moe_bridge import (FusedExpertReader, expert_bias_in_layer_order,
                                            map_sequential_experts, num_experts_of,
                                            router_fields)
from vime_shell.megatron.platform import Platform
from vime_shell.megatron.rope import (apply_rope_scaling, gpt_rope_args, rope_scaling_of,
                                      yarn_config_fields)

# model_type -> the bridge vime builds it with (mbridge's adjusted, or vime's own mapping);
# each adds its layers to the block spec (adapt_layer_spec) and its norms' names
# (EXTRA_NORM_NAMES) to adjustments 1 and 2, and Qwen3.5 its names' prefix (HF_NAME)
_OWN_BRIDGES: dict[str, Any] = {"deepseek_v3": DeepseekV3, "glm_moe_dsa": GlmMoeDsa, "glm4": Glm4,
                                "qwen3_5_text": Qwen3_5, "qwen3_5_moe_text": Qwen3_5Moe,
                                "qwen3_next": Qwen3Next, "minimax_m2": MiniMaxM2,
                                "gpt_oss": GptOss}

_LOCAL_NORM_NAMES = {
    "input_layernorm.weight": "model.layers.{n}.input_layernorm.weight",
    "pre_mlp_layernorm.weight": "model.layers.{n}.post_attention_layernorm.weight",
}


def read_hf_config(hf_dir: str | Path):
    """The transformers config of ``hf_dir``, normalised for mbridge (``rope_theta`` restored).

    Raises ``ModelLoadError`` for a missing ``config.json`` or a RoPE variant the bridge cannot
    convert (``vime_shell.megatron.rope``: default, linear and llama3 pass). Example: a
    transformers-5 Qwen2 config with ``rope_parameters={"rope_theta": 1e4, "rope_type":
    "default"}`` comes back with ``rope_theta == 1e4``.
    """
    path = Path(hf_dir)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{str(path)!r}: has no config.json. Fix: pass a directory "
                             "written by save_pretrained (config.json + *.safetensors).")
    try:
        config = auto_config(path)
    except (KeyError, ValueError, TypeError) as exc:  # transformers validates rope_parameters
        raise ModelLoadError(f"{str(path / 'config.json')!r}: transformers rejects it "
                             f"({type(exc).__name__}: {one_line(str(exc))}). Fix: correct the "
                             "key it names, as the model's source has it.") from None
    rope = getattr(config, "rope_parameters", None) or {}
    if getattr(config, "rope_theta", None) is None:  # adjustment 3
        if "rope_theta" not in rope:
            raise ModelLoadError(f"{str(path / 'config.json')!r}: has no \"rope_theta\". Fix: "
                                 "use a RoPE model (Qwen2/Qwen3/Llama) with it set.")
        config.rope_theta = rope["rope_theta"]
    if "partial_rotary_factor" in rope and getattr(config, "partial_rotary_factor",
                                                   None) is None:
        # GLM-4.5's half-rotated heads: transformers 5 moved it into rope_parameters too,
        # mbridge's GLM-4.5 bridge reads the attribute
        config.partial_rotary_factor = rope["partial_rotary_factor"]
    if not is_mla(config):  # MLA applies its own RoPE and YaRN (mla_bridge.py)
        rope_scaling_of(rope or getattr(config, "rope_scaling", None),  # refuses the rest
                        config.model_type)
    return config


def make_bridge(hf_dir: str | Path, platform: Platform, options: ModelOptions = ModelOptions(),
                layout: TrainLayout | None = None, sequence_parallel: bool = False):
    """An mbridge ``Bridge`` for ``hf_dir`` with the platform's adjustments (module docstring),
    the run's recompute / MoE ``options``, ``layout``'s uneven pipeline stages and Megatron's
    sequence parallelism (as ``layout.sequence_parallel_on`` decided it).

    Needs Megatron's parallel state to be initialised (it reads TP/PP/VPP/EP sizes from it).
    """
    config = read_hf_config(hf_dir)
    own = _OWN_BRIDGES.get(config.model_type)  # mbridge's, adjusted, or vime's mapping
    try:
        bridge = own(config, dtype=platform.dtype) if own is not None else \
            AutoBridge.from_config(config, dtype=platform.dtype)  # adjustment 4
    except ValueError as exc:
        raise ModelLoadError(f"{str(Path(hf_dir) / 'config.json')!r}: \"model_type\" "
                             f"{config.model_type!r}: {one_line(str(exc))}. Fix: use a Qwen2/"
                             "Qwen3 (dense or MoE), Qwen3.5, Qwen3-Next, MiniMax-M2, Llama, DeepSeek-V3, "
                             "Kimi-K2, GLM-4, GLM-4.5 or gpt-oss checkpoint.") from None
    # Adjustment 5 is the platform's overrides; they come last, so a field the run's options
    # also set (moe_router_fusion=False under routing replay) takes the platform's value.
    bridge.set_extra_args(**{**options.transformer_fields(), **router_fields(config),
                             **_stage_fields(layout),
                             **platform.transformer_overrides(sequence_parallel)})
    bridge.hf_dir = Path(hf_dir)
    _adjust_rope(bridge, config)

    use_te = platform.transformer_engine

    def layer_spec(vp_stage=None):  # adjustment 1
        spec = get_gpt_decoder_block_spec(bridge.config, use_transformer_engine=use_te,
                                          normalization="RMSNorm", vp_stage=vp_stage)
        return bridge.adapt_layer_spec(spec, transformer_engine=use_te, vp_stage=vp_stage) \
            if own else spec

    bridge.has_vp_stage = True
    bridge._get_transformer_layer_spec = layer_spec
    to_hf = bridge._weight_name_mapping_mcore_to_hf

    # Qwen3's local q/k norms share the MLA norms' names: these are MLA's only for MLA models
    norm_names = {**_LOCAL_NORM_NAMES, **getattr(own, "EXTRA_NORM_NAMES", {})}
    hf_name = getattr(own, "HF_NAME", None) or (lambda name: name)

    mtp_names = None if options.mtp_loss_scaling_factor is None else _mtp_names(hf_dir, config)

    def name_to_hf(name: str) -> list[str]:  # adjustment 2
        mtp_layer = None if mtp_names is None else \
            mtp.hf_names(name, config.num_hidden_layers, mtp_names, name_to_hf)  # mtp.py
        if mtp_layer is not None:
            return mtp_layer
        for suffix, template in norm_names.items():
            if name.startswith("decoder.layers.") and name.endswith(suffix):
                return [hf_name(template.format(n=name.split(".")[2]))]
        return [hf_name(n) for n in to_hf(name)]

    bridge._weight_name_mapping_mcore_to_hf = name_to_hf
    if mtp_names is not None:  # --enable-mtp-training
        bridge.set_extra_args(mtp_num_layers=int(config.num_nextn_predict_layers),
                              mtp_loss_scaling_factor=options.mtp_loss_scaling_factor)
        mtp.adjust_bridge(bridge, mtp_names, layer_spec, use_te)
    if num_experts_of(config) is not None:
        _adjust_expert_names(bridge)
        reader = bridge._get_safetensor_io
        fused = getattr(own, "FUSED_EXPERTS", ())  # the checkpoint's layout of fused experts
        bridge._get_safetensor_io = lambda path: FusedExpertReader(reader(path), *fused)
    return bridge


def _mtp_names(hf_dir: str | Path, config) -> "mtp.MtpNames":
    """How the checkpoint names the MTP layers ``--enable-mtp-training`` trains
    (:mod:`vime_shell.megatron.mtp`), by its own ``model_type`` (MiMo's reads as Qwen2's);
    a checkpoint without MTP layers vime maps is a ``ModelLoadError``."""
    kind = json.loads((Path(hf_dir) / "config.json").read_text()).get("model_type")
    layers = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if kind not in mtp.NAMES_OF or layers < 1:
        raise ModelLoadError(
            f"--enable-mtp-training: the checkpoint (model_type {kind!r}, "
            f"num_nextn_predict_layers {layers}) has no multi-token prediction layers vime "
            f"trains ({', '.join(MTP_MODEL_TYPES)}). Fix: drop --enable-mtp-training "
            "(--mtp-num-layers carries the layers untrained).")
    return mtp.NAMES_OF[kind]


def _stage_fields(layout: TrainLayout | None) -> dict[str, object]:
    """Megatron's uneven pipeline split (``--decoder-first/last-pipeline-num-layers``)."""
    if layout is None:
        return {}
    return {"num_layers_in_first_pipeline_stage": layout.first_stage_layers,
            "num_layers_in_last_pipeline_stage": layout.last_stage_layers}


def _adjust_rope(bridge, config) -> None:
    """The checkpoint's RoPE scaling, in place of mbridge's (``vime_shell.megatron.rope``),
    and its partial RoPE: the first ``partial_rotary_factor`` of each head rotated (GLM-4's,
    GLM-4.5's, Qwen3.5's, MiniMax-M2's; transformers 5 keeps it in ``rope_parameters``)."""
    rope = getattr(config, "rope_parameters", None) or {}
    scaling = rope_scaling_of(None if is_mla(config) else  # MLA applies its own (mla_bridge)
                              rope or getattr(config, "rope_scaling", None), config.model_type)
    partial = None if is_mla(config) else rope.get("partial_rotary_factor")
    gpt_args = bridge._get_gptmodel_args

    def gptmodel_args() -> dict:
        args = gpt_args()
        args.pop("seq_len_interpolation_factor", None)
        args.pop("rope_scaling", None)
        if partial is not None:
            args["rotary_percent"] = float(partial)
        return {**args, **gpt_rope_args(scaling)}

    bridge._get_gptmodel_args = gptmodel_args
    bridge.rope_scaling = scaling
    yarn = yarn_config_fields(scaling)
    if yarn:  # attributes, not fields: set on every config the bridge builds
        build = bridge._build_config

        def build_config():
            built = build()
            for key, value in yarn.items():
                setattr(built, key, value)
            return built

        bridge._build_config = build_config
        bridge.config = build_config()


def _adjust_expert_names(bridge) -> None:
    """``SequentialMLP`` expert names in mbridge's grouped form (MoE adjustment 2)."""
    local_to_global = bridge._weight_name_mapping_mcore_local_to_global

    def mapping(model, consider_ep: bool = True) -> dict[str, str]:
        names = local_to_global(model, consider_ep=consider_ep)
        ep_size, ep_rank = bridge.mpu.ep_size, bridge.mpu.ep_rank
        per_rank = bridge.config.num_moe_experts // ep_size
        return map_sequential_experts(names, ep_rank=ep_rank if consider_ep else 0,
                                      experts_per_rank=per_rank)

    bridge._weight_name_mapping_mcore_local_to_global = mapping


def build_model_chunks(bridge, platform: Platform, layout: TrainLayout,
                       load_weights: bool = True) -> list[torch.nn.Module]:
    """Unwrapped ``GPTModel`` chunks of this rank (``layout.vpp`` of them), weights loaded."""
    provider = bridge._model_provider([])
    chunks = []
    for stage in range(layout.vpp):
        vp = stage if layout.vpp > 1 else None
        chunk = provider(
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            vp_stage=vp)
        chunk.model_type = ModelType.encoder_or_decoder
        chunk.vp_stage = vp
        apply_rope_scaling(chunk, bridge.rope_scaling)
        mtp.attach(chunk)
        expert_bias_in_layer_order(chunk)
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if platform.kind == "cuda":
            chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)
    if load_weights:
        with torch.no_grad():
            bridge.load_weights(chunks, str(bridge.hf_dir))
    return chunks


def export_hf_weights(bridge, chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight, gathered over TP and PP.

    Collective: every rank of the model-parallel group must drain the iterator together. Each
    rank receives every tensor (full, unsharded), so any rank can sync or save.

    The embedding under PP: the first stage holds it and the last stage a copy, as the tied
    output layer or as the MTP layers' embedding (Megatron all-reduces their gradients, so
    they stay equal), and mbridge exports both as ``model.embed_tokens.weight``. The name is
    yielded once; a copy that differs is an error, never a silent choice.
    """
    seen: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in bridge.export_weights(chunks):
            if name in seen:
                if not torch.equal(seen[name], tensor):
                    raise ModelLoadError(
                        f"{name}: the pipeline's two copies of the embedding differ (max "
                        f"{float((seen[name] - tensor).abs().max()):.3g}). Fix: report this; "
                        "the embedding gradients were not all-reduced between the first and "
                        "last stage.")
                continue
            if name.endswith("embed_tokens.weight"):
                seen[name] = tensor.detach()
            yield name, tensor.detach()


def hf_state_dict(bridge, chunks: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """All exported weights as a dict of CPU tensors (small models, tests, checkpoints)."""
    return {name: t.to("cpu", copy=True) for name, t in export_hf_weights(bridge, chunks)}
