"""A stand-in for a real instruct model, built offline: a tiny Qwen2 with a byte-level BPE
tokenizer trained with ``tokenizers`` and a Qwen-style chat template, saved as an HF directory.

It takes the path a user with ``Qwen2.5-0.5B-Instruct`` takes: ``AutoTokenizer`` loads it and
``apply_chat_template`` renders ``<|im_start|>user ... <|im_end|>`` turns. ``eos_token``
picks the tokenizer's EOS: ``<|im_end|>`` (an instruct tokenizer) or ``<|endoftext|>`` (a base
tokenizer under a chat template, where only the template says a turn ends at ``<|im_end|>``);
``tie_word_embeddings`` shares the embedding with the LM head as Qwen2.5-0.5B does.
Example: ``build_chat_model(tmp / "qwen")`` -> a ~0.2M-parameter model with a ~400-token
vocabulary.
"""

from pathlib import Path

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

from vime_shell.models.tiny_model import TinyModelSpec, random_hf_model

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Qwen2.5's way with tools, in short: an assistant turn writes its calls as <tool_call> JSON
# blocks, a tool result comes back as a user turn in <tool_response> (agent sessions).
QWEN_TOOL_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if message['content'] %}{{- message['content'] }}"
    "{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' "
    "+ call['function']['arguments'] + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CORPUS = [f"What is {a} + {b}? Put the final answer in \\boxed{{}}. The answer is "
          f"\\boxed{{{a + b}}}." for a in range(12) for b in range(12)]


def build_chat_model(path: Path, vocab_size: int = 400, *, eos_token: str = "<|im_end|>",
                     tie_word_embeddings: bool = False, num_layers: int = 2,
                     generation_eos: bool = True, vocab_multiple: int = 1,
                     num_kv_heads: int = 1, max_position_embeddings: int = 512) -> Path:
    """Write the tokenizer and a random model to ``path``; returns it. ``generation_eos``:
    ``generation_config.json`` names the EOS (False leaves it out, like a base checkpoint);
    ``vocab_multiple``: pad the model's embedding rows to a multiple (Qwen's 151936 rows for
    151665 tokens), so TP sizes divide them; ``max_position_embeddings``: the context
    (Qwen2.5-0.5B-Instruct's is 32768)."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token,
                                   pad_token="<|endoftext|>", padding_side="left")
    fast.chat_template = QWEN_TEMPLATE
    fast.save_pretrained(path)
    rows = -(-len(fast) // vocab_multiple) * vocab_multiple
    spec = TinyModelSpec(vocab_size=rows, hidden_size=64, num_layers=num_layers,
                         num_heads=2, num_kv_heads=num_kv_heads, head_dim=32,
                         intermediate_size=128, max_position_embeddings=max_position_embeddings,
                         tie_word_embeddings=tie_word_embeddings, seed=5)
    model = random_hf_model(spec, pad_token_id=fast.pad_token_id, eos_token_id=fast.eos_token_id,
                            bos_token_id=None)
    model.generation_config = GenerationConfig(
        pad_token_id=fast.pad_token_id,
        eos_token_id=fast.eos_token_id if generation_eos else None)
    model.save_pretrained(path, safe_serialization=True)
    return path


# The agent example's template: ChatML turns with the role as its first letter and no
# whitespace (a Qwen2 tokenizer class rebuilds its byte-level pre-tokenizer, which a char-level
# vocabulary of whitespace would not survive), so a turn's content sits a few tokens before the
# reply it asks for; its alphabet: the letters, digits and marks the example writes.
AGENT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'][0] + (message['content'] or '') + '<|im_end|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>a' }}{%- endif %}")
AGENT_ALPHABET = string.ascii_lowercase + string.digits + "<>/_?=#"


def build_agent_chat_model(path: Path, *, hidden_size: int = 128, num_layers: int = 2) -> Path:
    """A char-level instruct model for the agent example (``vime_shell.agents.lookup_example``):
    ``<|im_start|>`` / ``<|im_end|>`` turns rendered by :data:`AGENT_TEMPLATE` over a
    ~46-token vocabulary, so a random policy hits any one reply token about once in 50
    samples (an RL run on CPU can discover a tool call). Example: ``build_agent_chat_model(tmp /
    "agent")`` -> a ~0.4M-parameter Qwen2 and its tokenizer."""
    alphabet = sorted(set(AGENT_ALPHABET))
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=len(SPECIALS) + len(alphabet),
                                  special_tokens=list(SPECIALS), initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(["".join(alphabet)], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", padding_side="left")
    fast.chat_template = AGENT_TEMPLATE
    fast.save_pretrained(path)
    spec = TinyModelSpec(vocab_size=len(fast), hidden_size=hidden_size, num_layers=num_layers,
                         num_heads=2, num_kv_heads=1, head_dim=64,
                         intermediate_size=2 * hidden_size, max_position_embeddings=512, seed=7)
    model = random_hf_model(spec, pad_token_id=fast.pad_token_id, eos_token_id=fast.eos_token_id,
                            bos_token_id=None)
    model.generation_config = GenerationConfig(pad_token_id=fast.pad_token_id,
                                               eos_token_id=fast.eos_token_id)
    model.save_pretrained(path, safe_serialization=True)
    return path
