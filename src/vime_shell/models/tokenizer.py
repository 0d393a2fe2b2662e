"""Loading a model directory's tokenizer the way rollouts need it (left padding), and the token
ids generation stops at.

Example: ``load_tokenizer(build_embedded())("47>")["input_ids"]`` has 3 ids.
"""

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

_PROBE = "VIME-END-OF-TURN-PROBE"


def load_tokenizer(model_dir: str | Path):
    """Load a model directory's tokenizer with left padding (loading resets the side)."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.padding_side = "left"
    return tokenizer


def default_stop_token_ids(tokenizer: Any, model_dir: str | Path, *,
                           chat_template: bool) -> tuple[int, ...]:
    """The tokens generation stops at without ``--rollout-stop-token-ids``: the tokenizer's
    EOS, the model's ``generation_config.json`` ``eos_token_id`` (one id or a list, as vLLM
    reads it) and, with ``--apply-chat-template``, the template's end-of-turn token.

    Why: an instruct model's tokenizer often keeps the base model's EOS (``<|endoftext|>``)
    while the chat template ends each turn with ``<|im_end|>``; stopping only at the EOS lets
    every response run to the length limit past the end of its turn.
    Example: a Qwen-style tokenizer with EOS ``<|endoftext|>`` (id 0) and a template ending
    turns with ``<|im_end|>`` (id 2) gives ``(0, 2)`` with ``chat_template=True``.
    """
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    ids += generation_config_eos(model_dir)
    if chat_template:
        end = template_end_of_turn(tokenizer)
        if end is not None:
            ids.append(end)
    return tuple(dict.fromkeys(ids))


def generation_config_eos(model_dir: str | Path) -> list[int]:
    """``eos_token_id`` of ``model_dir/generation_config.json`` as a list (none: ``[]``)."""
    path = Path(model_dir).expanduser() / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    values = eos if isinstance(eos, list) else [eos]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


def template_end_of_turn(tokenizer: Any) -> int | None:
    """The special token the chat template writes right after an assistant message, or None.

    The template renders a probe conversation; the first token after the probe's text is the
    end-of-turn when it is a special (added) token: ``<|im_end|>`` for Qwen, ``<|eot_id|>``
    for Llama 3. Example: ``"...assistant\\nPROBE<|im_end|>\\n"`` gives ``<|im_end|>``'s id.
    """
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render a turn names no end
        return None
    if not isinstance(text, str) or _PROBE not in text:
        return None
    tail = text.split(_PROBE, 1)[1]
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
    special = set(tokenizer.all_special_ids) | {
        int(i) for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return int(ids[0]) if ids and int(ids[0]) in special else None
