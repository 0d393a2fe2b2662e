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
from vime_pure.data.shards import merge_rollout_shares, prompt_shares
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
