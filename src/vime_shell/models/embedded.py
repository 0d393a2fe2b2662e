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

import json
import os
import shutil
import tempfile
from pathlib import Path

import attrs

from vime_pure.errors import field_error
from vime_shell.models.embedded_spec import (BUNDLED_TEXT, CHAT_TEMPLATE, SPECIAL_TOKENS,
                                             EmbeddedError, EmbeddedSpec)

__all__ = ["BUNDLED_TEXT", "CHAT_TEMPLATE", "SPECIAL_TOKENS", "EmbeddedError", "EmbeddedSpec",
           "build_embedded", "default_cache_dir"]

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
        raise field_error(EmbeddedError, "the embedded model's cache", str(root),
                          f"cannot be created ({exc})",
                          "pass a writable directory or set VIME_CACHE_DIR") from exc
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        # torch, transformers, tokenizers: imported only when a build is needed, because the
        # launch checks (torch-free by design) import this module for the path
        from vime_shell.models.embedded_build import write_model_dir

        write_model_dir(spec, tmp)
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
