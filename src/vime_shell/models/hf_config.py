"""What launch checks need from a Hugging Face ``config.json``, read without transformers.

Importing transformers costs seconds; the checks that run before anything heavy (layer count
for pipeline stages, vocabulary size for tensor parallelism, the architecture) need only the
JSON. ``vime_shell.megatron.bridge.read_hf_config`` reads the full config for the model itself.
Every key launch reads is checked first (``check_config``): a malformed ``config.json`` (not a
JSON object, a key missing, a string or a negative where a count belongs) is one
``ModelLoadError`` naming the flag, the file and the key, never a traceback.

Example: the embedded model's directory gives ``HfConfigSummary(model_type="qwen2",
num_layers=2, vocab_size=20, max_position_embeddings=64, num_attention_heads=2)``.
"""

import json
from pathlib import Path
from typing import Any, TypeGuard

import attrs

from vime_pure.errors import VimeError, field_error, one_line


EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # Qwen, Mixtral, DeepSeek


class ModelLoadError(VimeError):
    """An HF model directory that cannot be loaded, with the reason and the fix."""


@attrs.frozen(kw_only=True)
class HfConfigSummary:
    model_type: str
    num_layers: int
    vocab_size: int
    max_position_embeddings: int | None
    num_attention_heads: int | None = None  # vLLM's TP size must divide it
    num_key_value_heads: int | None = None  # None: as many as attention heads (MHA)
    num_experts: int | None = None  # routed experts of an MoE model; None: dense
    dtype: str | None = None  # "torch_dtype" (or transformers 5's "dtype"), e.g. "bfloat16"
    # GLM-5's per-layer DSA indexer, "full" or "shared" (sparse_indexer_types); None elsewhere
    indexer_types: tuple[str, ...] | None = None


def read_config_summary(hf_dir: str | Path, flag: str = "--hf-checkpoint") -> HfConfigSummary:
    """The fields above from ``hf_dir/config.json`` (a ``text_config`` merged over it), each
    checked (``check_config``: a malformed one is a ``ModelLoadError`` naming ``flag``, the
    file and the key)."""
    config = read_config_json(hf_dir, flag)
    check_config(config, _path(hf_dir), flag, required=SUMMARY_REQUIRED)
    return HfConfigSummary(
        model_type=str(config.get("model_type", "?")),
        num_layers=config["num_hidden_layers"], vocab_size=config["vocab_size"],
        max_position_embeddings=config.get("max_position_embeddings"),
        num_attention_heads=config.get("num_attention_heads"),
        num_key_value_heads=config.get("num_key_value_heads"),
        num_experts=next((config[k] for k in EXPERT_KEYS if config.get(k)), None),
        dtype=_dtype_name(config.get("torch_dtype") or config.get("dtype")),
        indexer_types=sparse_indexer_types(config, _path(hf_dir), flag))


def sparse_indexer_types(config: dict, path: Path, flag: str = "--hf-checkpoint"
                         ) -> tuple[str, ...] | None:
    """Which layers of a GLM-5 run their own DSA indexer (``"full"``) and which reuse the last
    full layer's selection (``"shared"``): ``indexer_types`` as stated, else derived as
    transformers' ``GlmMoeDsaConfig`` derives it (``index_topk_pattern`` of F / S, else every
    ``index_topk_freq``-th layer from ``index_skip_topk_offset``); None for other models.
    Example: 6 layers, freq 2, offset 2 give full, full, shared, full, shared, full."""
    if config.get("model_type") not in DSA_MODEL_TYPES:
        return None
    layers = config["num_hidden_layers"]
    pattern = config.get("indexer_types", config.get("index_topk_pattern"))
    if isinstance(pattern, str):
        pattern = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    if pattern is None:
        freq = max(int(config.get("index_topk_freq", 1)), 1)
        offset = int(config.get("index_skip_topk_offset", 2))
        pattern = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                   for i in range(layers)]
    if not isinstance(pattern, list) or len(pattern) != layers or \
            set(pattern) - {"full", "shared"} or pattern[:1] != ["full"]:
        raise _malformed(flag, path, f'"indexer_types" is {_shown(pattern)}: not "full" or '
                         f'"shared" for each of the {layers} layers, the first full',
                         "state them as the model's source does")
    return tuple(pattern)


def read_config_json(hf_dir: str | Path, flag: str = "--hf-checkpoint") -> dict:
    """``config.json`` as a dict, a multimodal model's ``text_config`` merged over it (the
    decoder's shape lives there); JSON that is not an object is a ``ModelLoadError``. Example:
    the embedded model gives ``{"model_type": "qwen2", "num_hidden_layers": 2, ...}``."""
    path = _path(hf_dir)
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise _malformed(flag, path, "does not exist",
                         "pass a Hugging Face model directory (save_pretrained writes "
                         "config.json)") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _malformed(flag, path, f"is not readable JSON ({type(exc).__name__}: "
                         f"{one_line(str(exc), 80)})") from None
    if not isinstance(config, dict):
        raise _malformed(flag, path, f"holds {_kind(config)}, not a JSON object of settings")
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise _malformed(flag, path, f'"text_config" is {_kind(text)}, not a JSON object')
    return {**config, **text} if isinstance(text, dict) else config


# What launch reads from config.json, by the kind of value each key must hold. A key missing
# or null takes the model family's default, except the required ones.
POSITIVE_INTS = ("num_hidden_layers", "vocab_size", "hidden_size", "num_attention_heads",
                 "intermediate_size", "num_key_value_heads", "head_dim",
                 "max_position_embeddings", "moe_intermediate_size", "num_experts_per_tok",
                 "decoder_sparse_step")
NON_NEGATIVE_INTS = (*EXPERT_KEYS, "shared_expert_intermediate_size", "n_shared_experts",
                     "first_k_dense_replace")  # 0 allowed: a dense model, no shared expert
POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta")
BOOLS = ("tie_word_embeddings",)
OBJECTS = ("rope_parameters", "rope_scaling")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")  # one id, or a list (EOS)
# The keys every model's config.json gives: the trainer, the FLOPs model and the memory
# estimate read them; the summary alone (layouts, vocabulary) needs the first two.
SUMMARY_REQUIRED = ("num_hidden_layers", "vocab_size")
REQUIRED = (*SUMMARY_REQUIRED, "hidden_size", "num_attention_heads", "intermediate_size",
            "model_type")


# model_type -> the transformers model_type of the same architecture (models/auto_config.py)
MODEL_TYPE_ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3", "mimo": "qwen2"}
# MoE models with no dense layer, whose config.json states no dense intermediate_size
MOE_ONLY_TYPES: tuple[str, ...] = ("qwen3_5_moe_text",)
# multimodal model_type -> its language model's, which vime trains (models/auto_config.py)
LANGUAGE_MODEL_OF: dict[str, str] = {"qwen3_5": "qwen3_5_text",
                                     "qwen3_5_moe": "qwen3_5_moe_text"}
# multi-latent attention (megatron/mla_bridge.py)
MLA_MODEL_TYPES: tuple[str, ...] = ("deepseek_v3", "kimi_k2", "glm4_moe_lite", "glm_moe_dsa")
# DeepSeek sparse attention on MLA: GLM-5 (megatron/glm5_bridge.py, sparse_attention.py)
DSA_MODEL_TYPES: tuple[str, ...] = ("glm_moe_dsa",)
# multi-token prediction layers vime trains (--enable-mtp-training, megatron/mtp.py): the
# DeepSeek-V3-style ones (decoder layers num_hidden_layers + i; GLM-4.5's too) and MiMo's
# (model.mtp_layers); GLM-5's MTP layer has sparse attention, which vime's MTP block lacks
MTP_MODEL_TYPES: tuple[str, ...] = (*(t for t in MLA_MODEL_TYPES if t not in DSA_MODEL_TYPES),
                                    "glm4_moe", "mimo")
# sigmoid routers with an expert bias (DeepSeek-V3's, GLM-4.5's): Megatron renormalises their
# top-k always
SIGMOID_ROUTERS: tuple[str, ...] = (*MLA_MODEL_TYPES, "glm4_moe", "minimax_m2")
# Model families the trainer's bridge cannot build yet, by config.json's model_type: each
# failed deep inside model construction or needs a part vime lacks; refused at launch with
# the reason instead. The families vime builds: Qwen2, Qwen3, their MoE variants, Llama,
# DeepSeek-V3, Kimi-K2, GLM-4.7-Flash (multi-latent attention) and GLM-5 (with sparse
# attention), GLM-4 (megatron/glm4_bridge.py), GLM-4.5 / 4.6 / 4.7 MoE
# (megatron/moe_bridge.py), gpt-oss (megatron/gpt_oss_bridge.py).
MODEL_TYPE_REFUSALS: dict[str, str] = {
    "deepseek_v2": "DeepSeek-V2 (mbridge has no bridge for it; DeepSeek-V3, R1 and Moonlight "
    "train as deepseek_v3)",
    **dict.fromkeys(("qwen2_5_vl", "qwen2_vl", "glm4v", "internvl_chat"),
                    "multimodal models (vime trains on text token ids)"),
}


def first_dense_layers(types: Any, path: Path | str, stated: Any = None) -> int:
    """GLM-4.7-Flash's ``mlp_layer_types`` (what transformers' GLM class builds) as DeepSeek-V3's
    ``first_k_dense_replace`` (what vLLM's reads; a real config.json states both): how many
    layers come first as dense. Any other pattern, or a ``stated`` count that disagrees, is a
    ``ModelLoadError`` (DeepSeek-V3, the model vime builds it as, has no other). Example:
    ``["dense", "sparse", "sparse"]`` gives 1."""
    ok = isinstance(types, list) and all(t in ("dense", "sparse") for t in types)
    k = next((i for i, t in enumerate(types) if t != "dense"), len(types)) if ok else 0
    if not ok or list(types) != ["dense"] * k + ["sparse"] * (len(types) - k):
        raise _malformed("--hf-checkpoint", Path(path), f'"mlp_layer_types" is {types!r}, not '
                         "dense layers followed by MoE layers, the only layout of DeepSeek-V3's, "
                         "which vime builds GLM-4.7-Flash as",
                         "use a checkpoint whose dense layers come first")
    if stated is not None and stated != k:
        raise _malformed("--hf-checkpoint", Path(path), f'"first_k_dense_replace" is {stated!r} '
                         f'but "mlp_layer_types" has {k} dense layers first (transformers '
                         "builds the one, vLLM the other)", "make the two agree")
    return k


def check_config(config: dict, path: Path, flag: str = "--hf-checkpoint",
                 required: tuple[str, ...] = REQUIRED) -> None:
    """Every key launch reads holds a value of its kind (the tuples above), the ``required``
    ones are there, token ids lie below ``vocab_size`` and the heads divide as attention needs.
    Example: ``{"vocab_size": "20", ...}`` raises ``ModelLoadError: --hf-checkpoint='m/config.
    json': "vocab_size" is "20" (a string), not a positive integer. Fix: ...``."""
    for key in required:
        if key == "intermediate_size" and config.get("moe_intermediate_size") is not None \
                and config.get("model_type") in MOE_ONLY_TYPES:
            continue  # every layer is MoE: no dense width to state
        if config.get(key) is None:
            raise _malformed(flag, path, f'has no "{key}" (every model\'s config.json gives '
                             "it)", f'add "{key}" as the model\'s source has it')
    kinds = ((POSITIVE_INTS, "a positive integer", lambda v: _int(v) and v > 0),
             (NON_NEGATIVE_INTS, "a non-negative integer", lambda v: _int(v) and v >= 0),
             (POSITIVE_NUMBERS, "a positive number",
              lambda v: isinstance(v, int | float) and not isinstance(v, bool) and v > 0),
             (BOOLS, "true or false", lambda v: isinstance(v, bool)),
             (OBJECTS, "a JSON object", lambda v: isinstance(v, dict)),
             (("model_type", "torch_dtype", "dtype"), "a non-empty string",
              lambda v: isinstance(v, str) and v != ""))
    for keys, want, ok in kinds:
        for key in keys:
            value = config.get(key)
            if value is not None and not ok(value):
                raise _malformed(flag, path, f'"{key}" is {_shown(value)}, not {want}')
    refused = MODEL_TYPE_REFUSALS.get(config["model_type"]) if "model_type" in required \
        else None
    if refused is not None:
        raise _malformed(flag, path, f'has "model_type" {config["model_type"]!r}: not '
                         f"supported in vime ({refused})", "train a Qwen2, Qwen3 (dense or "
                         "MoE), Qwen3.5 (dense or MoE), Qwen3-Next, MiniMax-M2, Llama, DeepSeek-V3, Kimi-K2, GLM-4, gpt-oss, GLM-4.5 "
                         "(dense or MoE) or GLM-5 checkpoint")
    if config.get("model_type") in ("glm4_moe_lite", "glm_moe_dsa") and "mlp_layer_types" in config:
        first_dense_layers(config["mlp_layer_types"], path, config.get("first_k_dense_replace"))
    _check_special_token_ids(config, path, flag)
    _check_heads(config, path, flag)


def _check_special_token_ids(config: dict, path: Path, flag: str) -> None:
    vocab = config.get("vocab_size")
    for key in TOKEN_IDS:
        value = config.get(key)
        ids = value if isinstance(value, list) else [value]
        # -1: "no such token" in some older conversions
        if value is not None and not all(_int(i) and i >= -1 and (vocab is None or i < vocab)
                                         for i in ids):
            raise _malformed(flag, path, f'"{key}" is {_shown(value)}, not a token id (or a '
                             f'list of them) below "vocab_size" {vocab}')


def _check_heads(config: dict, path: Path, flag: str) -> None:
    """Attention splits ``hidden_size`` over the heads (unless ``head_dim`` is given) and the
    query heads into groups of the KV heads."""
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    hidden = config.get("hidden_size")
    if heads and kv and heads % kv:
        raise _malformed(flag, path, f'"num_attention_heads" {heads} is not a multiple of '
                         f'"num_key_value_heads" {kv}')
    if heads and hidden and config.get("head_dim") is None and hidden % heads:
        raise _malformed(flag, path, f'"hidden_size" {hidden} is not a multiple of '
                         f'"num_attention_heads" {heads}, and no "head_dim" is given')


def _int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: object) -> str:
    """``a string``, ``a list``, ... (the JSON name of a value's type)."""
    return {str: "a string", list: "a list", dict: "an object", bool: "a boolean",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _shown(value: object) -> str:
    """A value as JSON writes it, with its kind when that is the problem: ``"20" (a string)``."""
    text = one_line(json.dumps(value), 60)
    return text if isinstance(value, int | float) and not isinstance(value, bool) \
        else f"{text} ({_kind(value)})"


def _malformed(flag: str, path: Path, problem: str, fix: str | None = None) -> ModelLoadError:
    return field_error(ModelLoadError, flag, str(path), problem, fix or (
        "correct it to the model's own value (as its source's config.json has it), or point "
        f"{flag} at an intact model directory"))


def _path(hf_dir: str | Path) -> Path:
    return Path(hf_dir).expanduser() / "config.json"


def _dtype_name(value: object) -> str | None:
    """``"bfloat16"`` from ``"bfloat16"`` or ``"torch.bfloat16"``; None when unset."""
    return value.removeprefix("torch.") if isinstance(value, str) and value else None


def has_chat_template(hf_dir: str | Path) -> bool:
    """True when the tokenizer of ``hf_dir`` ships a chat template (``chat_template.jinja`` or
    a ``chat_template`` entry in ``tokenizer_config.json``), read without transformers."""
    root = Path(hf_dir).expanduser()
    if (root / "chat_template.jinja").is_file():
        return True
    try:
        config = json.loads((root / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(isinstance(config, dict) and config.get("chat_template"))
