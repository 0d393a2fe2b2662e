"""Building the embedded default model (:mod:`vime_shell.models.embedded`): the char-level
tokenizer trained on the bundled alphabet and the random Qwen2 of an ``EmbeddedSpec``, written
as a Hugging Face model directory. Heavy (torch, transformers, tokenizers): imported only when
a build is needed.

Example: ``write_model_dir(EmbeddedSpec(), tmp)`` writes ``config.json``,
``model.safetensors`` and ``tokenizer.json`` (1.3 MB, 334k parameters, 20 vocabulary rows).
"""

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from vime_shell.models.embedded_spec import (BUNDLED_TEXT, CHAT_TEMPLATE, SPECIAL_TOKENS,
                                             EmbeddedSpec)
from vime_shell.models.tiny_model import TinyModelSpec, random_hf_model


def write_model_dir(spec: EmbeddedSpec, directory: Path) -> None:
    """The tokenizer and the model of ``spec`` saved into ``directory`` (safetensors)."""
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(directory)
    _save_quietly(_build_model(spec, tokenizer), directory)


def tiny_model_spec(spec: EmbeddedSpec, vocab_size: int) -> TinyModelSpec:
    """The generic tiny-model shape of ``spec`` (one model builder for the whole project)."""
    return TinyModelSpec(
        arch="qwen2", vocab_size=vocab_size, hidden_size=spec.hidden_size,
        num_layers=spec.num_hidden_layers, num_heads=spec.num_attention_heads,
        num_kv_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings, seed=spec.seed)


def _save_quietly(model, directory: Path) -> None:
    """``save_pretrained`` without transformers' "Writing model shards" bar: the build happens
    inside ``vime train``'s launch checks, whose errors must stay one line."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(directory, safe_serialization=True)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def build_tokenizer():
    """Train the char-level tokenizer on :data:`BUNDLED_TEXT`; a ``PreTrainedTokenizerFast``.

    Example: ``build_tokenizer()("47>")["input_ids"]`` has 3 ids; ``<eos>`` is id 1.
    """
    alphabet = sorted(set(BUNDLED_TEXT))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # Every character is its own pre-token, and no merges are learned: a char-level vocabulary.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=len(SPECIAL_TOKENS) + len(alphabet),
                                  special_tokens=list(SPECIAL_TOKENS), initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator([BUNDLED_TEXT], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left",
                                   model_max_length=1 << 16)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build_model(spec: EmbeddedSpec, tokenizer):
    """The random model of ``spec`` for ``tokenizer``'s vocabulary, reserved rows at zero."""
    num_tokens = len(tokenizer)
    model = random_hf_model(tiny_model_spec(spec, spec.padded_vocab_size(num_tokens)),
                            pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    with torch.no_grad():  # reserved rows (module docstring): never produced, logit 0
        model.get_input_embeddings().weight[num_tokens:] = 0.0
        model.get_output_embeddings().weight[num_tokens:] = 0.0
    model.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id,
                                               eos_token_id=tokenizer.eos_token_id)
    return model
