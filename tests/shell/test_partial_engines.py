"""``--partial-rollout`` over several engines (``vime_pure.data.shards.partial_shares``): each
engine keeps a buffer of its own, starts the round's new prompts after the groups it carried
(its places: its share of ``--over-sampling-batch-size``) and completes its share of the
batch; the checkpoint holds every engine's buffer and a resume hands each engine its own.

One gloo job, 2 colocated ranks with an engine each, 4 prompt groups per rollout from 6
places, a deterministic long-tailed ``generate``: rollouts 0-1, a checkpoint, rollout 2
resumed; the same checkpoint resumed on one engine (a world of 1) for rollout 3; and the same
first two phases on 2 engine ranks of their own (a world of 3, synchronous), and 3 rollouts
there one step off (``K = 2``). Asserts: every rollout trains 4 groups (2 per engine), the buffers carry groups into
every later rollout (the resumed one too), masks are 0 exactly on tokens from older weights,
and across the checkpoint every drawn prompt trains exactly once, or waits in a buffer.
"""

import re
from collections import Counter

import pytest

from tests.shell.agentic_workers import partial_engines_worker
from vime_shell.megatron.spawn import spawn
from vime_shell.models.tokenizer import load_tokenizer
from vime_shell.rollout.tasks import arithmetic_rows, write_jsonl

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory, embedded_cache):
    root = tmp_path_factory.mktemp("partial-engines")
    rows = write_jsonl(f"{root}/data/train.jsonl", arithmetic_rows()[0])
    ranks = spawn(partial_engines_worker, 2, str(root), embedded_cache, str(rows))
    for name in ("first", "rest"):  # every rank gathers the same batches
        assert [r["prompts"] for r in ranks[0][name]] == [r["prompts"] for r in ranks[1][name]]
    one = spawn(partial_engines_worker, 1, str(root), embedded_cache, str(rows),
                ("one_engine",))[0]
    separate = spawn(partial_engines_worker, 3, str(root), embedded_cache, str(rows),
                     ("separate", "one_step_off"))[0]
    return ranks[0] | one | separate | {"cache": embedded_cache}


def test_two_engines_carry_their_groups_and_complete_their_share(runs):
    records = [r["metrics"] for r in runs["first"] + runs["rest"]]
    assert [m["rollout"] for m in records] == [0, 1, 2]
    assert all(m["prompts_kept"] == 4 for m in records)
    assert records[0]["partial/resumed_groups"] == 0
    assert all(m["partial/resumed_groups"] == 2 for m in records[1:])  # one per engine
    assert all(m["partial/buffered_groups"] == 2 for m in records)
    assert runs["waiting"] == 2  # the checkpoint holds both engines' buffered groups
    assert any(m["partial/offpolicy_token_frac"] > 0 for m in records[1:])


@pytest.mark.parametrize("names, drawn, trained", [(("first", "rest"), 14, 12),
                                                    (("first", "rest", "one_engine"), 18, 16),
                                                    (("separate",), 14, 12),
                                                    (("one_step_off",), 14, 12)])
def test_every_drawn_prompt_trains_once_across_the_checkpoints(runs, names, drawn, trained):
    """6 + 4 + 4 prompts drawn on 2 engines, 12 trained (4 samples each), 2 still buffered:
    of the first 14 rows of the dataset, none twice, none lost. Resumed on one engine, which
    takes both engines' buffered groups: 4 more drawn, 4 more trained."""
    from vime_shell.models.embedded import build_embedded

    tok = load_tokenizer(build_embedded(runs["cache"]))
    rows = [row["prompt"] for row in arithmetic_rows()[0]]
    counts = Counter(re.search(r"\d\+\d", tok.decode(p)).group()
                     for name in names for r in runs[name] for p in r["prompts"])
    assert set(counts.values()) == {4}
    assert len(counts) == trained and set(counts) <= set(rows[:drawn])


def test_one_engine_resumes_both_engines_buffered_groups(runs):
    (record,) = [r["metrics"] for r in runs["one_engine"]]
    assert record["rollout"] == 3 and record["prompts_kept"] == 4
    assert record["partial/resumed_groups"] == 2


def test_older_tokens_are_masked_and_newer_ones_train(runs):
    spanning = 0
    for r in runs["first"][1:] + runs["rest"]:
        for mask in r["masks"]:
            if 0 in mask:  # resumed under newer weights: its first tokens are masked
                spanning += 1
                zeros = mask.index(1) if 1 in mask else len(mask)
                assert mask == [0] * zeros + [1] * (len(mask) - zeros)
    assert spanning > 0


def test_engine_ranks_of_their_own_carry_and_resume_their_buffers(runs):
    """The same on 2 engine ranks of their own: the engine side keeps every engine's buffer,
    the trainer's checkpoint holds them, a resume hands each engine rank its own."""
    records = [r["metrics"] for r in runs["separate"]]
    assert [m["rollout"] for m in records] == [0, 1, 2]
    assert all(m["prompts_kept"] == 4 and m["partial/buffered_groups"] == 2 for m in records)
    assert [m["partial/resumed_groups"] for m in records] == [0, 2, 2]
    assert runs["separate_waiting"] == 2


def test_engine_ranks_one_step_off_carry_groups_within_the_bound(runs):
    """One step off, each engine rank's buffered groups train one version later than the
    batch they started in: staleness 2 at most (``K = 2``), older tokens masked."""
    records = [r["metrics"] for r in runs["one_step_off"]]
    assert [m["rollout"] for m in records] == [0, 1, 2]
    assert [m["partial/resumed_groups"] for m in records] == [0, 2, 2]
    assert max(m["staleness_max"] for m in records) <= 2
    assert any(m["staleness_max"] == 2 for m in records)
