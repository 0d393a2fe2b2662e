"""The transformers config of a model directory, for checkpoints whose ``model_type`` names
an architecture transformers has under another name.

Kimi-K2 (``model_type`` ``kimi_k2``) ships its config and model as remote code, and both are
DeepSeek-V3's (``architectures`` is ``DeepseekV3ForCausalLM``, the same keys and weight
names): :data:`vime_shell.models.hf_config.MODEL_TYPE_ALIASES` maps it onto transformers'
``deepseek_v3`` classes, so the trainer's bridge and the HF engine build it without running
the checkpoint's code. A real Kimi-K2 tokenizer is remote code too (tiktoken), which vime does
not run: such a directory needs a tokenizer transformers loads.

Example: ``auto_config(path)`` of a ``kimi_k2`` directory is a ``DeepseekV3Config`` with the
directory's sizes; of any other, ``AutoConfig.from_pretrained(path)``.
"""

import json
from pathlib import Path

from transformers import AutoConfig

from vime_shell.models.hf_config import MODEL_TYPE_ALIASES


def auto_config(model_dir: str | Path):
    path = Path(model_dir)
    data = json.loads((path / "config.json").read_text())
    alias = MODEL_TYPE_ALIASES.get(data.get("model_type"))
    if alias is None:
        return AutoConfig.from_pretrained(path)
    keys = {k: v for k, v in data.items() if k not in ("model_type", "auto_map")}
    return AutoConfig.for_model(alias, **keys)
