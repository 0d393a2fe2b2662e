"""The transformers config of a model directory, for checkpoints whose ``model_type`` names
an architecture transformers has under another name, or an architecture vime builds as
another's.

Kimi-K2 (``model_type`` ``kimi_k2``) ships its config and model as remote code, and both are
DeepSeek-V3's (``architectures`` is ``DeepseekV3ForCausalLM``, the same keys and weight
names): :data:`vime_shell.models.hf_config.MODEL_TYPE_ALIASES` maps it onto transformers'
``deepseek_v3`` classes, so the trainer's bridge and the HF engine build it without running
the checkpoint's code. A real Kimi-K2 tokenizer is remote code too (tiktoken), which vime does
not run: such a directory needs a tokenizer transformers loads. MiMo (``mimo``, remote code
too) is Qwen2 with multi-token prediction layers (``model.mtp_layers.*``, which Qwen2's
classes leave unloaded): it reads as ``qwen2``.

GLM-4.7-Flash (``glm4_moe_lite``) is DeepSeek-V3's architecture under GLM's config: the same
weight names (multi-latent attention, a sigmoid router with an expert bias, a shared expert),
its dense layers listed by ``mlp_layer_types`` instead of ``first_k_dense_replace``, and GLM's
defaults (``routed_scaling_factor`` 1.8, ``rms_norm_eps`` 1e-5). Its config is read by
transformers' own class, so GLM's defaults fill what config.json leaves out, and handed on
as a ``DeepseekV3Config`` (transformers' two classes give equal logits on the same weights;
``tests/shell/test_mla.py``); the trainer's bridge is DeepSeek-V3's, no mapping of vime's own.
A layer pattern other than dense layers first is refused (DeepSeek-V3 has no other).
GLM-5 (``glm_moe_dsa``) is that model with sparse attention: its config stays transformers'
own (the HF engine needs GLM-5's class), with the dense-layer count read the same way.

Qwen3.5 (``qwen3_5``) ships as a multimodal model whose language model is
``Qwen3_5ForCausalLM`` (``qwen3_5_text``, the ``text_config``): vime trains that, so the
config is the text config, with the checkpoint's ``tie_word_embeddings`` (which the outer
config states for the whole model). ``AutoModelForCausalLM`` builds the same text model from
such a directory.

Example: ``auto_config(path)`` of a ``kimi_k2`` directory is a ``DeepseekV3Config`` with the
directory's sizes; of any other, ``AutoConfig.from_pretrained(path)``.
"""

import json
from pathlib import Path

from transformers import AutoConfig

from vime_shell.models.hf_config import (LANGUAGE_MODEL_OF, MODEL_TYPE_ALIASES,
                                         first_dense_layers)


def auto_config(model_dir: str | Path):
    path = Path(model_dir)
    data = json.loads((path / "config.json").read_text())
    kind = data.get("model_type")
    if kind == "glm4_moe_lite":
        return _glm4_moe_lite(path)
    if kind == "glm_moe_dsa":
        return _glm_moe_dsa(path)
    if kind in LANGUAGE_MODEL_OF:
        return _language_model(path)
    alias = MODEL_TYPE_ALIASES.get(kind)
    if alias is None:
        return AutoConfig.from_pretrained(path)
    keys = {k: v for k, v in data.items() if k not in ("model_type", "auto_map")}
    return AutoConfig.for_model(alias, **keys)


def _glm4_moe_lite(path: Path):
    """GLM-4.7-Flash's config as DeepSeek-V3's (module docstring)."""
    keys = AutoConfig.from_pretrained(path).to_dict()
    keys["first_k_dense_replace"] = first_dense_layers(keys.pop("mlp_layer_types"),
                                                       path / "config.json",
                                                       keys.get("first_k_dense_replace"))
    keys = {k: v for k, v in keys.items() if k not in ("model_type", "architectures")}
    return AutoConfig.for_model("deepseek_v3", **keys)


def _glm_moe_dsa(path: Path):
    """GLM-5's own config (the HF engine runs transformers' ``GlmMoeDsaForCausalLM``), with
    ``first_k_dense_replace`` read from ``mlp_layer_types`` as for GLM-4.7-Flash (the trainer
    builds the model as DeepSeek-V3's, ``megatron/glm5_bridge.py``)."""
    config = AutoConfig.from_pretrained(path)
    config.first_k_dense_replace = first_dense_layers(
        config.mlp_layer_types, path / "config.json",
        json.loads((path / "config.json").read_text()).get("first_k_dense_replace"))
    return config


def _language_model(path: Path):
    """The text config of a multimodal checkpoint whose language model vime trains."""
    config = AutoConfig.from_pretrained(path)
    text = config.text_config
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    return text
