"""Stop controls on a real vLLM (the community CPU build): with a base tokenizer (EOS
``<|endoftext|>``, none in the generation config) under a Qwen chat template, responses end at
the template's ``<|im_end|>`` once it is a stop token (``default_stop_token_ids``, what
``vime train --apply-chat-template`` passes), and at ``--rollout-stop`` strings, keeping the
token that completed the string. The same per-request seeds give the same draws, so each
stopped response is exactly the unstopped one cut after its stop; nothing else changes.

Skips cleanly without ``vllm`` (the main venv); ``make test-vllm`` runs it.
"""

import os

import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.stop_helpers import assert_cut_at_string, assert_cut_at_token  # noqa: E402
from vime_shell.engines import SamplingParams, select_engine  # noqa: E402
from vime_shell.models.chat_model import build_chat_model  # noqa: E402
from vime_shell.models.tokenizer import default_stop_token_ids, load_tokenizer  # noqa: E402
from vime_shell.rollout.functions import encode_prompt  # noqa: E402
from vime_shell.rollout.tasks import TaskExample  # noqa: E402


@pytest.fixture(scope="module")
def base_eos(tmp_path_factory):
    path = build_chat_model(tmp_path_factory.mktemp("m") / "qwen", eos_token="<|endoftext|>",
                            tie_word_embeddings=True, generation_eos=False)
    tok = load_tokenizer(path)
    engine = select_engine("vllm", path, seed=0, max_model_len=128, enforce_eager=True)
    rows = [TaskExample(prompt=f"What is {i} + 2?", label=str(i + 2)) for i in range(48)]
    prompts = [encode_prompt(tok, r, apply_chat_template=True) for r in rows]
    yield path, tok, engine, prompts
    engine.close()


def test_vllm_responses_stop_at_im_end_with_a_base_eos(base_eos):
    path, tok, engine, prompts = base_eos
    im_end, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id
    stops = default_stop_token_ids(tok, path, chat_template=True)
    assert stops == (eos, im_end)
    common = dict(max_new_tokens=48, temperature=2.0, seed=11)  # vLLM: <= 2
    before = engine.generate(prompts, SamplingParams(stop_token_ids=(eos,), **common))
    after = engine.generate(prompts, SamplingParams(stop_token_ids=stops, **common))
    assert_cut_at_token(before, after, im_end)


def test_vllm_stop_strings_cut_after_the_completing_token(base_eos):
    _, tok, engine, prompts = base_eos
    common = dict(max_new_tokens=24, temperature=2.0, seed=3)
    free = engine.generate(prompts[:16], SamplingParams(**common))
    # A whole ASCII token as the stop string: a random byte-level model also draws partial
    # UTF-8 bytes, whose text vLLM's incremental detokenizer holds back until the character
    # completes (a stop string ending in "\ufffd" would match one token later there).
    pieces = [tok.decode([t]) for g in free for t in g.token_ids[2:]]
    stop = next(p for p in pieces if len(p.strip()) >= 2 and p.isascii() and p.isprintable())
    cut = engine.generate(prompts[:16], SamplingParams(stop=(stop,), **common))
    assert_cut_at_string(free, cut, tok.decode, stop)
