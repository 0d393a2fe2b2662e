"""Stop controls: generation ends at the chat template's end-of-turn token even when the
tokenizer's EOS is the base model's, at ``--rollout-stop`` strings, and within
``--rollout-max-context-len``; the ``--eval-*`` overrides replace their rollout settings."""

import pytest

from tests.stop_helpers import assert_cut_at_string, assert_cut_at_token
from vime_shell.engines.base import EngineError, SamplingParams, stop_string_end
from vime_shell.engines.hf import HfEngine
from vime_shell.models.chat_model import build_chat_model
from vime_shell.models.tokenizer import default_stop_token_ids, load_tokenizer
from vime_shell.rollout.functions import encode_prompt
from vime_shell.rollout.tasks import TaskExample


@pytest.fixture(scope="module")
def base_eos_chat_model(tmp_path_factory):
    """Tied, BPE, Qwen template, EOS ``<|endoftext|>`` and no EOS in the generation config:
    only the template says that a turn ends at ``<|im_end|>``."""
    path = build_chat_model(tmp_path_factory.mktemp("m") / "qwen", eos_token="<|endoftext|>",
                            tie_word_embeddings=True, generation_eos=False)
    return path, load_tokenizer(path)


def _prompts(tok, n):
    rows = [TaskExample(prompt=f"What is {i} + 2?", label=str(i + 2)) for i in range(n)]
    return [encode_prompt(tok, r, apply_chat_template=True) for r in rows]


def test_chat_template_end_of_turn_is_a_default_stop(base_eos_chat_model):
    path, tok = base_eos_chat_model
    im_end, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id
    assert tok.eos_token == "<|endoftext|>"
    assert default_stop_token_ids(tok, path, chat_template=True) == (eos, im_end)
    assert default_stop_token_ids(tok, path, chat_template=False) == (eos,)


def test_responses_stop_at_im_end_with_a_base_eos(base_eos_chat_model):
    path, tok = base_eos_chat_model
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    engine = HfEngine(path)
    prompts = _prompts(tok, 48)
    base = SamplingParams(max_new_tokens=40, temperature=3.0, seed=11,
                          stop_token_ids=(tok.eos_token_id,))
    chat = SamplingParams(max_new_tokens=40, temperature=3.0, seed=11,
                          stop_token_ids=default_stop_token_ids(tok, path, chat_template=True))
    before, after = engine.generate(prompts, base), engine.generate(prompts, chat)
    assert_cut_at_token(before, after, im_end)


def test_stop_strings_cut_after_the_completing_token(base_eos_chat_model):
    path, tok = base_eos_chat_model
    engine = HfEngine(path)
    prompts = _prompts(tok, 16)
    free = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=3.0, seed=3))
    texts = [tok.decode(g.token_ids) for g in free]
    stop = next(t[4:6] for t in texts if len(t) > 8)  # two characters one response holds
    cut = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=3.0, seed=3,
                                                  stop=(stop,)))
    assert_cut_at_string(free, cut, tok.decode, stop)


def test_max_context_len_caps_each_request(base_eos_chat_model):
    path, tok = base_eos_chat_model
    engine = HfEngine(path)
    short, long = _prompts(tok, 1)[0][-3:], _prompts(tok, 1)[0]
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=0,
                            max_context_len=len(long) + 4)
    gens = engine.generate([short, long], params)
    assert [len(g.token_ids) for g in gens] == [10, 4]
    assert gens[1].finish_reason == "length"
    with pytest.raises(EngineError, match="max_context_len"):
        engine.generate([long], SamplingParams(max_new_tokens=4, max_context_len=len(long)))


def test_stop_string_end_is_the_shortest_prefix():
    pieces = {1: "ab", 2: "c</", 3: "a>", 4: "zz"}
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    assert stop_string_end([1, 2, 3, 4], decode, ("</a>",)) == 3
    assert stop_string_end([1, 2, 3, 4], decode, ("zz", "c<")) == 2
    assert stop_string_end([1, 2], decode, ("</a>",)) is None

