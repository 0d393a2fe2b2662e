"""Prompt datasets: JSONL and Parquet, the configured keys, typed errors naming the line, and a
seeded, epoch-aware shuffle that a resumed run continues."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vime_shell.rollout.data import (DataError, DataKeys, PromptSource, fit_prompts,
                                     load_prompt_rows)
from vime_shell.rollout.tasks import TaskExample, get_task

ROWS = [{"question": f"{a}+{b}=", "answer": str(a + b), "meta": {"level": a % 3}}
        for a in range(4) for b in range(3)]
KEYS = DataKeys(input_key="question", label_key="answer", metadata_key="meta")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_and_parquet_give_the_same_examples(tmp_path):
    from_jsonl = load_prompt_rows(_jsonl(tmp_path / "train.jsonl", ROWS), KEYS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "train.parquet")
    from_parquet = load_prompt_rows(tmp_path / "train.parquet", KEYS)
    assert from_jsonl == from_parquet
    assert from_jsonl[4] == TaskExample(prompt="1+1=", label="2", metadata={"level": 1})


def test_chat_messages_and_tools_are_kept(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "2+2="}], "label": 4, "tools": [{"n": 1}]}]
    (example,) = load_prompt_rows(_jsonl(tmp_path / "chat.jsonl", rows),
                                  DataKeys(tool_key="tools"))
    assert example.prompt[1]["content"] == "2+2=" and example.label == 4  # a number stays one
    assert example.tools == [{"n": 1}]


@pytest.mark.parametrize("lines, keys, match", [
    (['{"question": "1+1=", "answer": "2"}', '{"question": "2+2="}'], KEYS,
     r"train.jsonl:2: no 'answer' field .*Fix: pass --label-key"),
    (['{"prompt": "x"}'], KEYS, r"train.jsonl:1: no 'question' field"),
    (['{"question": "1+1=", "answer": "2"', ], KEYS, r"train.jsonl:1: not valid JSON"),
    (['{"question": "", "answer": "2"}'], KEYS, r"train.jsonl:1: question='' is neither"),
    (['{"question": "1+1=", "answer": "2", "meta": 5}'], KEYS, "not a dict"),
    ([], KEYS, "holds no rows")])
def test_bad_rows_are_typed_errors_naming_the_line(tmp_path, lines, keys, match):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + ("\n" if lines else ""))
    with pytest.raises(DataError, match=match):
        load_prompt_rows(path, keys)


def test_missing_file_is_a_typed_error(tmp_path):
    with pytest.raises(DataError, match="--prompt-data=.*is not a file"):
        load_prompt_rows(tmp_path / "nope.jsonl", KEYS)


@given(st.lists(st.integers(1, 9), min_size=1, max_size=12), st.booleans(), st.integers(0, 3))
def test_a_resumed_source_continues_the_same_order(takes, shuffle, seed):
    """Theorem: the order depends on (seed, epoch) and the offset only, so a fresh source set
    to a saved offset continues exactly where the first one stood."""
    rows = tuple(TaskExample(prompt=str(k)) for k in range(7))
    whole = PromptSource.from_dataset(rows, shuffle=shuffle, seed=seed)
    drawn = [e.prompt for n in takes for e in whole.take(n)]
    half = len(takes) // 2
    first = PromptSource.from_dataset(rows, shuffle=shuffle, seed=seed)
    head = [e.prompt for n in takes[:half] for e in first.take(n)]
    resumed = PromptSource.from_dataset(rows, shuffle=shuffle, seed=seed,)
    resumed.offset, resumed.draws = first.offset, first.draws
    assert head + [e.prompt for n in takes[half:] for e in resumed.take(n)] == drawn


@given(st.integers(0, 6), st.lists(st.integers(0, 9), min_size=1, max_size=6))
def test_prompts_put_back_come_first_and_only_the_rest_is_drawn(carried, takes):
    """Prompts put back (a --partial-rollout checkpoint resumed without it) are handed out
    before any new one; the source draws only the rest, so after them it continues as if
    they had never been taken: nothing drawn is lost, nothing repeats."""
    rows = tuple(TaskExample(prompt=str(k)) for k in range(40))
    back = tuple(TaskExample(prompt=f"back{k}") for k in range(carried))
    plain = PromptSource.from_dataset(rows, shuffle=True, seed=1)
    source = PromptSource.from_dataset(rows, shuffle=True, seed=1)
    source.carried = back
    got = [e for n in takes for e in source.take(n)]
    expected = list(back) + list(plain.take(sum(takes)))
    assert got == expected[:sum(takes)]
    assert source.carried == back[sum(takes):] and source.draws == len(takes)


def test_every_epoch_is_a_permutation_and_shuffles_differ_across_epochs():
    rows = tuple(TaskExample(prompt=str(k)) for k in range(20))
    source = PromptSource.from_dataset(rows, shuffle=True, seed=0)
    first, second = ([e.prompt for e in source.take(20)] for _ in range(2))
    assert sorted(first) == sorted(second) == sorted(str(k) for k in range(20))
    assert first != second and source.epoch == 2


def test_a_task_source_draws_what_the_task_draws_per_rollout():
    source = PromptSource.from_task(get_task("reverse2"), seed=3)
    assert source.take(16) == get_task("reverse2").examples(16, seed=3, rollout_id=0)
    assert source.take(16) == get_task("reverse2").examples(16, seed=3, rollout_id=1)


@pytest.mark.parametrize("source", [
    PromptSource.from_dataset(tuple(TaskExample(prompt=str(k)) for k in range(4)), shuffle=True,
                              seed=0),
    PromptSource.from_task(get_task("reverse2"), seed=3)], ids=["dataset", "task"])
def test_the_probes_fixed_prompt_is_the_same_every_time_and_never_advances_the_source(source):
    first = source.fixed_prompt(7)
    assert source.fixed_prompt(7) == first and (source.offset, source.draws) == (0, 0)
    expected = (source.rows[0] if source.rows is not None
                else get_task("reverse2").examples(1, seed=3, rollout_id=7)[0])
    assert first == expected


def _keys(**kw):
    return DataKeys(input_key="question", label_key="answer", **kw)


@pytest.mark.parametrize("answer, match", [
    (None, r"train.jsonl:2: answer is null. Fix: .*--label-key none"),
    (float("nan"), r"train.jsonl:2: answer=nan is not a finite number"),
    (["21", "x"], r"train.jsonl:2: answer=\['21', 'x'\] is a list, but the built-in rewards"),
    ({"a": 1}, r"train.jsonl:2: answer=\{'a': 1\} is a dict")])
def test_labels_that_no_built_in_reward_can_grade_are_refused_with_the_line(tmp_path, answer,
                                                                            match):
    rows = [{"question": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": answer}]
    with pytest.raises(DataError, match=match):
        load_prompt_rows(_jsonl(tmp_path / "train.jsonl", rows), _keys(any_label=False))


def test_labels_keep_their_type_and_parquet_bytes_become_text(tmp_path):
    """43.0 stays a number (never "43.0"); a user reward receives list labels as they are."""
    rows = [{"question": "a", "answer": 43.0}, {"question": "b", "answer": 7}]
    got = load_prompt_rows(_jsonl(tmp_path / "n.jsonl", rows), _keys(any_label=False))
    assert [e.label for e in got] == [43.0, 7] and isinstance(got[1].label, int)
    listed = [{"question": "a", "answer": ["21", "x"]}]
    assert load_prompt_rows(_jsonl(tmp_path / "l.jsonl", listed), _keys())[0].label == ["21", "x"]
    pq.write_table(pa.Table.from_pylist([{"question": b"1+1=", "answer": b"43"}]),
                   tmp_path / "b.parquet")
    (example,) = load_prompt_rows(tmp_path / "b.parquet", _keys(any_label=False))
    assert example == TaskExample(prompt="1+1=", label="43")
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": b"\xff"}]),
                   tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad.parquet:1: answer=b'\\xff' is bytes that are not"):
        load_prompt_rows(tmp_path / "bad.parquet", _keys())


def test_non_utf8_bytes_name_the_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"question": "1+1=", "answer": "2"}\n'
                     b'{"question": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(DataError, match=r"train.jsonl:2: byte 18 of the line is not UTF-8"):
        load_prompt_rows(path, _keys())


def test_chat_messages_need_the_chat_template_and_blank_prompts_are_refused(tmp_path):
    chat = [{"question": [{"role": "user", "content": "2+2="}], "answer": "4"}]
    with pytest.raises(DataError, match=r"chat.jsonl:1: question is a list of 1 chat messages.*"
                                        "--apply-chat-template"):
        load_prompt_rows(_jsonl(tmp_path / "chat.jsonl", chat), _keys(apply_chat_template=False))
    with pytest.raises(DataError, match=r"blank.jsonl:1: question='  \\n' is blank"):
        load_prompt_rows(_jsonl(tmp_path / "blank.jsonl", [{"question": "  \n", "answer": "1"}]),
                         _keys())


def test_fit_prompts_refuses_empty_and_too_long_prompts_or_drops_and_counts():
    rows = (TaskExample(prompt="12"), TaskExample(prompt="1" * 60), TaskExample(prompt="3"))
    wheres = ("d.jsonl:1", "d.jsonl:2", "d.jsonl:3")
    encode = lambda e: [1] * len(e.prompt)  # noqa: E731 - one token per character
    with pytest.raises(DataError, match=r"d.jsonl:2: the prompt has 60 tokens, and with "
                                        r"--rollout-max-response-len 8 it exceeds .* 64"):
        fit_prompts(rows, wheres, encode=encode, context_len=64, response_len=8,
                    max_prompt_len=None)
    kept, dropped = fit_prompts(rows, wheres, encode=encode, context_len=64, response_len=8,
                                max_prompt_len=10)
    assert [e.prompt for e in kept] == ["12", "3"] and dropped == 1
    with pytest.raises(DataError, match=r"d.jsonl:1: the prompt '12' gives no tokens: none of "
                                        "its characters is in the tokenizer's vocabulary"):
        fit_prompts(rows, wheres, encode=lambda e: [], context_len=64, response_len=8,
                    max_prompt_len=None)
