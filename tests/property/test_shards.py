"""Prompt shares of several engines and the merge of their outputs (``vime_pure.data.shards``).

Properties: the shares partition ``range(P)`` in order with sizes within one of each other;
splitting any well-formed per-prompt output (depth >= 1) into engine shares and merging gives
the same ``RolloutBatch`` as the unsplit output; explicit ids reused by two engines are an error.
"""

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.property.data_strategies import rollout_outputs
from vime_pure import RolloutBatch, Sample
from vime_pure.data.shards import (GroupVerdict, PartialShare, cut_rounds, deal_groups,
                                   merge_rollout_shares, partial_shares, prompt_shares)
from vime_pure.errors import RolloutValidationError


def assert_same_batch(a: RolloutBatch, b: RolloutBatch) -> None:
    for field in attrs.fields(RolloutBatch):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            np.testing.assert_array_equal(x, y, err_msg=field.name)
        else:
            assert x == y, field.name


def test_docstring_example():
    assert prompt_shares(10, 4) == (range(0, 3), range(3, 6), range(6, 8), range(8, 10))
    assert prompt_shares(2, 3) == (range(0, 1), range(1, 2), range(2, 2))


@given(st.integers(0, 300), st.integers(1, 70))
def test_shares_partition_the_prompts_in_order(num_prompts, num_engines):
    """Block e starts where block e-1 ends and the first P mod E blocks take one extra prompt,
    so the blocks tile range(P) in order with sizes differing by at most one, largest first."""
    shares = prompt_shares(num_prompts, num_engines)
    assert len(shares) == num_engines
    assert [i for s in shares for i in s] == list(range(num_prompts))
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@given(rollout_outputs(), st.integers(1, 5))
def test_split_then_merge_gives_the_same_batch(output, num_engines):
    """Merging concatenates the parts in engine order, and the shares cut the output at prompt
    boundaries in that order, so the merge is the output itself (ids and all)."""
    if output and isinstance(output[0], Sample):
        return  # depth 0: the top level is samples, not prompts; nothing to split by prompt
    parts = [list(output[s.start:s.stop]) for s in prompt_shares(len(output), num_engines)]
    merged = merge_rollout_shares(parts)
    assert merged == list(output)
    assert_same_batch(RolloutBatch.from_samples(merged), RolloutBatch.from_samples(output))


def _prompt(gid, pg=None):
    return [Sample(tokens=[1, 2], response_length=1, reward=1.0, group_id=gid, prompt_group=pg)]


@pytest.mark.parametrize("field, parts", [
    ("group_id", [[_prompt(0)], [_prompt(0)]]),
    ("prompt_group", [[_prompt(None, "p")], [_prompt(None, "p")]]),
])
def test_an_explicit_id_used_by_two_engines_is_an_error(field, parts):
    with pytest.raises(RolloutValidationError, match=f"{field}=.*prompt chunks 0 and 1"):
        merge_rollout_shares(parts)


def test_ids_left_none_are_numbered_after_the_merge():
    merged = merge_rollout_shares([[_prompt(None)], [_prompt(None)]])
    assert RolloutBatch.from_samples(merged).original_group_ids() == [0, 1]


@pytest.mark.parametrize("bad", [Sample(tokens=[1], response_length=1), 3, "x"])
def test_a_part_that_is_not_a_list_is_an_error(bad):
    with pytest.raises(RolloutValidationError, match="engine 0 output"):
        merge_rollout_shares([bad])


@pytest.mark.parametrize("args", [(-1, 2), (3, 0), (True, 1)])
def test_bad_counts_are_errors(args):
    with pytest.raises(RolloutValidationError):
        prompt_shares(*args)


def test_partial_shares_docstring_example():
    assert partial_shares([2, 0], 8, 6) == (PartialShare(new=range(0, 2), target=3, slot=0),
                                             PartialShare(new=range(2, 6), target=3, slot=4))
    assert partial_shares([1], 6, 4) == (PartialShare(new=range(0, 5), target=4, slot=0),)
    assert deal_groups([["a", "b", "c"]], 2) == [["a", "c"], ["b"]]
    with pytest.raises(RolloutValidationError, match="need=7"):
        partial_shares([0, 0], 6, 7)


@st.composite
def partial_rounds(draw):
    engines = draw(st.integers(1, 5))
    per_round = draw(st.integers(0, 40))
    need = draw(st.integers(0, per_round))
    return draw(st.lists(st.integers(0, 12), min_size=engines, max_size=engines)), per_round, need


@given(partial_rounds())
def test_partial_shares_reach_the_round_from_any_buffers(case):
    """Theorem: every engine can complete its target (its buffered groups and new prompts
    hold enough), the targets add up to the round's need, the new prompts are one contiguous
    draw in engine order, an engine never starts more than its places allow, and the slots
    are distinct and in engine order (the merge's order). One engine is the single buffer's
    rule: ``per_round - buffered`` new prompts, target ``need``."""
    buffered, per_round, need = case
    shares = partial_shares(buffered, per_round, need)
    places = prompt_shares(per_round, len(buffered))
    assert sum(s.target for s in shares) == need
    assert [s.slot for s in shares] == [p.start for p in places]
    first = 0
    for share, held, place in zip(shares, buffered, places):
        assert share.new.start == first and share.new.step == 1
        first = share.new.stop
        assert held + len(share.new) >= share.target
        assert len(share.new) == max(len(place) - held, 0)
    if len(buffered) == 1:
        assert (len(shares[0].new), shares[0].target) == (max(per_round - buffered[0], 0), need)


@given(st.lists(st.lists(st.integers(), max_size=5), min_size=1, max_size=4),
       st.integers(1, 5))
def test_dealt_groups_keep_every_group_once(held, engines):
    """Theorem: a checkpoint's groups reach the engines of the resumed run exactly once each;
    with the engine count saved, each engine gets its own, in order."""
    tagged = [[(e, i, g) for i, g in enumerate(h)] for e, h in enumerate(held)]
    dealt = deal_groups(tagged, engines)
    assert len(dealt) == engines
    assert sorted(g for d in dealt for g in d) == sorted(g for h in tagged for g in h)
    if engines == len(held):
        assert dealt == tagged


def test_cut_rounds_docstring_example():
    verdicts = [GroupVerdict(key=(0, p), kept=k, next_group=0, rewards=() if k else (0.5,))
                for p, k in enumerate([True, False, True, True])]
    cut = cut_rounds(verdicts[::-1], 2, fill=False)
    assert (cut.keys, cut.filtered, cut.filled, cut.filtered_rewards) == (
        ((0, 0), (0, 2)), 1, 0, (0.5,))


@st.composite
def round_verdicts(draw):
    rounds = draw(st.integers(1, 3))
    verdicts = [GroupVerdict(key=(r, p), kept=draw(st.booleans()), next_group=0,
                        rewards=(float(r), float(p)))
                for r in range(rounds) for p in range(draw(st.integers(0, 6)))]
    return verdicts, draw(st.integers(0, 8)), draw(st.booleans()), draw(st.randoms())


@given(round_verdicts())
def test_cut_rounds_judges_in_round_and_prompt_order_whoever_sent_what(case):
    """Theorem: the cut is the one a single judge makes walking the groups in round and
    prompt order (kept until ``need``, the rest discarded unjudged; with ``fill`` the first
    dropped ones fill the rest), whatever order the leaders' verdicts arrive in."""
    verdicts, need, fill, rnd = case
    shuffled = list(verdicts)
    rnd.shuffle(shuffled)
    cut = cut_rounds(shuffled, need, fill=fill)
    kept, dropped = [], []
    for v in verdicts:  # the single judge, in order
        if len(kept) == need:
            break
        (kept if v.kept else dropped).append(v)
    filled = dropped[:need - len(kept)] if fill else []
    assert cut.keys == tuple(v.key for v in kept + filled)
    assert (cut.filtered, cut.filled) == (len(dropped), len(filled))
    assert cut.filtered_rewards == tuple(r for v in dropped for r in v.rewards)
    assert len(cut.keys) <= need and len(set(cut.keys)) == len(cut.keys)
