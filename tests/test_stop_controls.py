"""Stop controls: generation ends at the chat template's end-of-turn token even when the
tokenizer's EOS is the base model's, at ``--rollout-stop`` strings, and within
``--rollout-max-context-len``; the ``--eval-*`` overrides replace their rollout settings."""

import pytest

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
    ran_past = [i for i, g in enumerate(before) if im_end in g.token_ids[:-1]]
    assert ran_past, "no sample drew <|im_end|>: the test would show nothing"
    for i, (b, a) in enumerate(zip(before, after)):
        assert b.token_ids[:len(a.token_ids)] == a.token_ids  # same seeds, same draws
        if im_end in b.token_ids:
            cut = b.token_ids.index(im_end) + 1
            assert (a.token_ids, a.finish_reason) == (b.token_ids[:cut], "stop")
        else:
            assert a.token_ids == b.token_ids
    assert all(len(after[i].token_ids) < len(before[i].token_ids) for i in ran_past)


def test_stop_strings_cut_after_the_completing_token(base_eos_chat_model):
    path, tok = base_eos_chat_model
    engine = HfEngine(path)
    prompts = _prompts(tok, 16)
    free = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=3.0, seed=3))
    texts = [tok.decode(g.token_ids) for g in free]
    stop = next(t[4:6] for t in texts if len(t) > 8)  # two characters one response holds
    cut = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=3.0, seed=3,
                                                  stop=(stop,)))
    hits = 0
    for f, c in zip(free, cut):
        end = stop_string_end(f.token_ids, tok.decode, (stop,))
        if end is None:
            assert (c.token_ids, c.finish_reason) == (f.token_ids, f.finish_reason)
            continue
        hits += 1
        assert c.token_ids == f.token_ids[:end] and c.finish_reason == "stop"
        assert stop in tok.decode(c.token_ids) and stop not in tok.decode(c.token_ids[:-1])
    assert hits >= 1


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

