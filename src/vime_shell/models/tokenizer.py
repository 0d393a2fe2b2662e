"""Loading a model directory's tokenizer the way rollouts need it (left padding).

Example: ``load_tokenizer(build_embedded())("47>")["input_ids"]`` has 3 ids.
"""

from pathlib import Path

from transformers import AutoTokenizer


def load_tokenizer(model_dir: str | Path):
    """Load a model directory's tokenizer with left padding (loading resets the side)."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.padding_side = "left"
    return tokenizer
