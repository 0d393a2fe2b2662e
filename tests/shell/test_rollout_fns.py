"""Built-in rollout functions on the HF engine and the embedded model, validated by the data model.

Asserts :mod:`vime_shell.rollout.functions`' invariants: sample layout (tokens = prompt + response,
one mask / log-prob per response token), group ids unique per execution and shared by compact
siblings, prompt groups, metadata, rewards by exact match (single turn) or "all turns
correct" (compact), determinism of a context, diversity within a group, and that user rollout
functions load by import path and have their output validated.
"""

import sys
import textwrap

import pytest

from vime_pure.data.rollout_output import flatten_rollout_output
from vime_pure.data.sample import Sample, Status
from vime_pure.errors import RolloutValidationError
from vime_shell.models.embedded import EmbeddedSpec, build_embedded
from vime_shell.models.tokenizer import load_tokenizer
from vime_shell.engines import SamplingParams
from vime_shell.engines.hf import HfEngine
from vime_shell.rollout.plugins import PluginError
from vime_shell.rollout.functions import (
    RolloutContext, compact_rollout, encode_prompt, load_rollout_function, rollout_sampling_seed,
    single_turn_rollout,
)
from vime_shell.rollout.rewards import Rewarder
from vime_shell.rollout.tasks import TaskError, TaskExample, get_task

N_PROMPTS, N_SAMPLES = 3, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_embedded(tmp_path_factory.mktemp("embedded"), EmbeddedSpec(seed=0))


@pytest.fixture(scope="module")
def engine(model_dir):
    return HfEngine(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def run_rollout(fn, ctx):
    return flatten_rollout_output(fn(ctx))


def make_ctx(engine, tokenizer, *, task="reverse2", rollout_id=0, rewarder=None,
             num_turns=2, seed=0, turn_reward="mean", first_group_id=0):
    t = get_task(task)
    return RolloutContext(
        rollout_id=rollout_id, engine=engine, tokenizer=tokenizer, task=t,
        prompts=t.examples(N_PROMPTS, seed=seed, rollout_id=rollout_id),
        n_samples_per_prompt=N_SAMPLES, num_turns=num_turns,
        rewarder=rewarder or Rewarder.build(rm_type="exact"), turn_reward=turn_reward,
        first_group_id=first_group_id,
        sampling=SamplingParams(max_new_tokens=t.answer_length,
                                seed=rollout_sampling_seed(seed, rollout_id)))


def assert_sample_invariants(s: Sample, tokenizer) -> None:
    n = s.response_length
    assert n >= 1 and len(s.loss_mask) == len(s.rollout_log_probs) == n
    assert s.tokens[:-n] == tokenizer(s.metadata["prompt"])["input_ids"]
    assert tokenizer.decode(s.tokens[-n:], skip_special_tokens=True) == s.metadata["response"]
    assert s.status in (Status.COMPLETED, Status.TRUNCATED)
    assert s.reward in (0.0, 1.0)


def test_single_turn_layout_groups_and_rewards(engine, tokenizer):
    ctx = make_ctx(engine, tokenizer)
    out = single_turn_rollout(ctx)
    assert len(out) == N_PROMPTS and all(len(group) == N_SAMPLES for group in out)
    flat = run_rollout(single_turn_rollout, ctx)
    assert flat.depth == 1
    assert len(set(flat.group_ids)) == N_PROMPTS * N_SAMPLES  # every sample its own group
    assert flat.prompt_dense.tolist() == [j // N_SAMPLES for j in range(N_PROMPTS * N_SAMPLES)]
    for p, group in enumerate(out):
        assert {s.metadata["label"] for s in group} == {ctx.prompts[p].label}
        assert len({tuple(s.tokens) for s in group}) > 1, "a group's samples must differ"
        for s in group:
            assert_sample_invariants(s, tokenizer)
            assert s.reward == float(s.metadata["response"] == s.metadata["label"])


def test_same_context_same_samples_and_next_rollout_differs(engine, tokenizer):
    a = single_turn_rollout(make_ctx(engine, tokenizer, rollout_id=5))
    b = single_turn_rollout(make_ctx(engine, tokenizer, rollout_id=5))
    c = single_turn_rollout(make_ctx(engine, tokenizer, rollout_id=6))
    assert a == b
    assert a != c


@pytest.mark.parametrize("num_turns, turn_reward", [(2, "mean"), (3, "all")])
def test_compact_rollout_siblings_share_group_and_reward(engine, tokenizer, num_turns,
                                                          turn_reward):
    ctx = make_ctx(engine, tokenizer, num_turns=num_turns, turn_reward=turn_reward)
    flat = run_rollout(compact_rollout, ctx)
    assert flat.depth == 2
    assert len(flat.samples) == N_PROMPTS * N_SAMPLES * num_turns
    assert len(set(flat.group_ids)) == N_PROMPTS * N_SAMPLES
    out = compact_rollout(ctx)
    for p, executions in enumerate(out):
        for siblings in executions:
            assert [s.metadata["turn"] for s in siblings] == list(range(num_turns))
            assert len({s.group_id for s in siblings}) == 1
            turn_ok = [s.metadata["response"] == s.metadata["label"] for s in siblings]
            expected = all(turn_ok) if turn_reward == "all" else sum(turn_ok) / num_turns
            assert {s.reward for s in siblings} == {float(expected)}
            for prev, nxt in zip(siblings, siblings[1:]):  # compaction: only the last answer
                assert nxt.metadata["prompt"] == prev.metadata["response"] + ">"
                assert nxt.metadata["label"] == prev.metadata["label"][::-1]
            for s in siblings:
                assert_sample_invariants(s, tokenizer)


def test_compact_rollout_rejects_unchainable_task_and_bad_turns(engine, tokenizer):
    with pytest.raises(TaskError, match="count_a"):
        compact_rollout(make_ctx(engine, tokenizer, task="count_a"))
    with pytest.raises(TaskError, match="num_turns"):
        compact_rollout(make_ctx(engine, tokenizer, num_turns=4))
    with pytest.raises(TaskError, match="turn_reward"):
        compact_rollout(make_ctx(engine, tokenizer, turn_reward="max"))


def test_custom_reward_fn_is_used(engine, tokenizer):
    def by_index(sample):
        return sample.index / 10

    out = single_turn_rollout(make_ctx(engine, tokenizer, rewarder=Rewarder(fn=by_index)))
    assert [s.reward for group in out for s in group] == [j / 10 for j in range(12)]


def test_group_ids_start_at_the_rounds_first_id(engine, tokenizer):
    out = single_turn_rollout(make_ctx(engine, tokenizer, first_group_id=100))
    assert [s.group_id for group in out for s in group] == list(range(100, 112))


def test_chat_template_renders_text_and_message_prompts(tokenizer):
    class Chat:  # a tokenizer whose template is visible in the ids
        def apply_chat_template(self, messages, tools, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return "".join(m["content"] for m in messages) + ">"

        def __call__(self, text, add_special_tokens):
            return tokenizer(text, add_special_tokens=add_special_tokens)

    text = TaskExample(prompt="12")
    chat = TaskExample(prompt=[{"role": "system", "content": "3"}, {"role": "user",
                                                                    "content": "4"}])
    assert encode_prompt(Chat(), text, True) == tokenizer("12>")["input_ids"]
    assert encode_prompt(Chat(), chat, True) == tokenizer("34>")["input_ids"]
    assert encode_prompt(tokenizer, text, False) == tokenizer("12")["input_ids"]
    with pytest.raises(TaskError, match="--apply-chat-template"):
        encode_prompt(tokenizer, chat, False)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rollouts.py").write_text(textwrap.dedent("""
        from vime_pure.data.sample import Sample
        from vime_shell.rollout.functions import single_turn_rollout

        def tuples(ctx):
            return tuple(tuple(g) for g in single_turn_rollout(ctx))

        def broken(ctx):
            a = Sample(tokens=[3, 4, 5], response_length=1, group_id=7, reward=0.0)
            b = Sample(tokens=[3, 4, 6], response_length=1, group_id=8, reward=0.0)
            return [[[a, b]]]

        NOT_A_FUNCTION = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rollouts"
    sys.modules.pop("my_rollouts", None)


def test_user_rollout_function_by_import_path(engine, tokenizer, user_module):
    assert load_rollout_function(None) is single_turn_rollout
    fn = load_rollout_function(f"{user_module}:tuples")
    assert load_rollout_function(f"{user_module}.tuples") is fn
    flat = run_rollout(fn, make_ctx(engine, tokenizer))
    assert len(flat.samples) == N_PROMPTS * N_SAMPLES
    with pytest.raises(RolloutValidationError, match=r"output\[0\]\[0\]"):
        run_rollout(load_rollout_function(f"{user_module}:broken"), make_ctx(engine, tokenizer))


@pytest.mark.parametrize("path, match", [
    ("no_such_module_xyz:fn", "not importable"),
    ("my_rollouts:missing", "no attribute"),
    ("my_rollouts:NOT_A_FUNCTION", "not a function"),
    ("justaname", "names no module"),
])
def test_bad_rollout_function_paths_are_typed_errors(user_module, path, match):
    with pytest.raises(PluginError, match=match):
        load_rollout_function(path)
