"""A character-level fast tokenizer with Qwen's two special tokens and a Qwen3.5-shaped chat
template (role headers, ``<|im_end|>``, earlier turns' reasoning dropped): what
``--loss-mask-type qwen3_5`` reads, on a stand-in model small enough for the tests (102 ids:
the printable ASCII characters, then ``<|im_start|>`` and ``<|im_end|>``)."""

import string
from pathlib import Path

QWEN35_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ m['content'].split('</think>\n')[-1] }}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}")


def qwen35_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = {c: i for i, c in enumerate(sorted(set(string.printable)))}
    inner = Tokenizer(models.BPE(vocab=chars, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=inner)
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = QWEN35_TEMPLATE
    return fast


def with_qwen35_tokenizer(model_dir: Path) -> Path:
    """``model_dir`` with :func:`qwen35_tokenizer` saved beside its weights."""
    qwen35_tokenizer().save_pretrained(model_dir)
    return model_dir
