"""What launch checks need from a Hugging Face ``config.json``, read without transformers.

Importing transformers costs seconds; the checks that run before anything heavy (layer count
for pipeline stages, vocabulary size for tensor parallelism, the architecture) need only the
JSON. ``vime_shell.megatron.bridge.read_hf_config`` reads the full config for the model itself.

Example: the embedded model's directory gives ``HfConfigSummary(model_type="qwen2",
num_layers=2, vocab_size=20, max_position_embeddings=64, num_attention_heads=2)``.
"""

import json
from pathlib import Path

import attrs

from vime_pure.errors import VimeError


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


def read_config_summary(hf_dir: str | Path) -> HfConfigSummary:
    """The fields above from ``hf_dir/config.json`` (a ``text_config`` is looked into)."""
    path = Path(hf_dir).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text())
        text = config.get("text_config") or {}
        return HfConfigSummary(
            model_type=str(config.get("model_type", "?")),
            num_layers=int(config.get("num_hidden_layers") or text["num_hidden_layers"]),
            vocab_size=int(config.get("vocab_size") or text["vocab_size"]),
            max_position_embeddings=config.get("max_position_embeddings"),
            num_attention_heads=config.get("num_attention_heads") or text.get(
                "num_attention_heads"),
            num_key_value_heads=config.get("num_key_value_heads") or text.get(
                "num_key_value_heads"),
            num_experts=next((int(v) for k in EXPERT_KEYS
                              if (v := config.get(k) or text.get(k))), None),
            dtype=_dtype_name(config.get("torch_dtype") or config.get("dtype")
                              or text.get("torch_dtype") or text.get("dtype")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"hf_checkpoint={str(hf_dir)!r}: cannot read num_hidden_layers and "
                             f"vocab_size from config.json ({type(exc).__name__}: {exc}). Fix: "
                             "pass a directory written by save_pretrained.") from None


def read_config_json(hf_dir: str | Path) -> dict:
    """``config.json`` as a dict, a multimodal model's ``text_config`` merged over it (the
    decoder's shape lives there). Example: the embedded model gives ``{"model_type": "qwen2",
    "num_hidden_layers": 2, ...}``."""
    path = Path(hf_dir).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"hf_checkpoint={str(hf_dir)!r}: cannot read config.json "
                             f"({type(exc).__name__}: {exc}). Fix: pass a directory written "
                             "by save_pretrained.") from None
    text = config.get("text_config") if isinstance(config, dict) else None
    return {**config, **text} if isinstance(text, dict) else config


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
