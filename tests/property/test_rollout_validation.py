"""Rollout output validation and flattening: nesting depths, compact leaves, ids, loss masks."""

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vime_pure import (RolloutBatch, RolloutBatchError, RolloutValidationError, Sample,
                       fallback_ids, flatten_rollout_output, normalized_loss_mask)
from vime_pure.data.rollout_output import path_of
from tests.property.data_strategies import rollout_outputs

S = Sample


def _leaves(node, loc=()):
    """(location, leaf) of every container that directly holds samples, in order."""
    if node and isinstance(node[0], Sample):
        yield loc, node
        return
    for k, child in enumerate(node):
        yield from _leaves(child, loc + (k,))


def _at(output, loc):
    for k in loc:
        output = output[k]
    return output


@given(rollout_outputs(light=True))
def test_every_wellformed_nesting_is_accepted_in_order(output):
    """Flattening is a depth-first walk of a valid nesting: it accepts it, keeps the leaves'
    order and explicit ids, and a rollout group never spans prompts (validation rejects it)."""
    flat = flatten_rollout_output(output)
    expected = [s for _, leaf in _leaves(output) for s in leaf]
    assert [id(s) for s in flat.samples] == [id(s) for s in expected]
    for i, loc in enumerate(flat.locations):
        assert _at(output, loc) is flat.samples[i]
        assert flat.path(i) == path_of(loc)
    # Explicit ids kept; a rollout group lies in one prompt group.
    for s, gid in zip(flat.samples, flat.group_ids):
        assert s.group_id is None or gid == s.group_id
    prompt_of = {}
    for gid, prompt in zip(flat.group_ids, flat.prompt_groups):
        assert prompt_of.setdefault(gid, prompt) == prompt


@given(rollout_outputs(depth=1, light=True))
def test_depth1_prompt_groups_follow_the_outer_index(output):
    """At depth 1 the outer index is the prompt: one prompt group per outer entry."""
    flat = flatten_rollout_output(output)
    tops = [loc[0] for loc in flat.locations]
    assert len(set(zip(tops, flat.prompt_groups))) == len(set(tops)) == len(set(flat.prompt_groups))


@given(st.lists(st.none() | st.integers(-3, 12) | st.sampled_from(["a", "0", "1"]), max_size=30))
def test_fallback_never_collides_and_keeps_explicit_ids(ids):
    """Each None becomes, in order, the smallest non-negative int that no explicit id and no
    earlier fallback uses; explicit ids pass through."""
    out = fallback_ids(ids)
    explicit = {i for i in ids if i is not None}
    fresh = [o for i, o in zip(ids, out) if i is None]
    assert [o for i, o in zip(ids, out) if i is not None] == [i for i in ids if i is not None]
    assert len(set(fresh)) == len(fresh) and not set(fresh) & explicit
    assert all(type(f) is int and f >= 0 for f in fresh)
    # Smallest unused: every smaller non-negative int is taken.
    taken = explicit | set(fresh)
    assert all(k in taken for k in range(max(fresh, default=0)))


@given(rollout_outputs(depth=2, light=True), st.data())
def test_compact_leaf_with_missing_or_mismatched_id_is_rejected_with_its_path(output, data):
    """A multi-sample leaf is one rollout group: validation checks every sibling's id against
    the leaf's first and names the failing sample's path."""
    _check_corrupted_leaf(output, data)


@given(rollout_outputs(depth=3, light=True), st.data())
def test_compact_depth3_leaf_corruption_is_rejected(output, data):
    """The same leaf check at depth 3: it does not depend on how deep the leaf sits."""
    _check_corrupted_leaf(output, data)


def _check_corrupted_leaf(output, data):
    multi = [(loc, leaf) for loc, leaf in _leaves(output) if len(leaf) > 1]
    if not multi:
        return
    loc, leaf = data.draw(st.sampled_from(multi))
    victim = data.draw(st.integers(0, len(leaf) - 1))
    leaf[victim].group_id = data.draw(st.sampled_from([None, "mismatch-id"]))
    with pytest.raises(RolloutValidationError) as err:
        flatten_rollout_output(output)
    assert str(err.value).startswith(path_of(loc) + "[")
    assert "group_id" in str(err.value) and "Fix:" in str(err.value)


def test_tuples_anywhere_are_accepted():
    out = ([S(tokens=[1]), S(tokens=[2])], ((S(tokens=[3]),),)[0])
    assert [s.tokens for s in flatten_rollout_output(out).samples] == [[1], [2], [3]]


def test_error_names_the_deep_path():
    out = [[[S(group_id=1)]]] * 0 + [[[S(group_id=k)] for k in range(3 * p, 3 * p + 2)]
                                       for p in range(4)]
    out[3][1] = [S(group_id=11), S(group_id=11), S(group_id=12)]
    with pytest.raises(RolloutValidationError, match=r"^output\[3\]\[1\]\[2\]: group_id=12 but "
                                                     r"sibling output\[3\]\[1\]\[0\] has "
                                                     r"group_id=11"):
        flatten_rollout_output(out)


def test_uneven_fanout_keeps_groups_apart():
    out = [[S(), S(group_id="agent-7"), S(group_id="agent-7"), S()], [S()]]
    flat = flatten_rollout_output(out)
    assert flat.group_ids == (0, "agent-7", "agent-7", 1, 2)
    assert flat.prompt_groups == (0, 0, 0, 0, 1)


@pytest.mark.parametrize("bad, match", [
    (S(), r"output is a Sample.*wrap|list of Samples"),
    ([[S()], [[S()]]], r"output\[1\]\[0\]\[0\]: is a Sample at depth 2 but output\[0\]\[0\]"),
    ([[S(), [S()]]], r"output\[0\]\[1\]: is a list but its siblings are Samples"),
    ([[S(), {"tokens": [1]}]], r"output\[0\]\[1\]: holds \{'tokens'"),
    ([S(), S(prompt_group="q")], r"output\[0\]: prompt_group=None in a flat"),
    ([[S(group_id=5)], [S(group_id=5)]], r"output\[1\]\[0\]: group_id=5 .* collide"),
    ([[[S(group_id=5)], [S(group_id=5)]]], r"output\[0\]\[1\]\[0\]: group_id=5 is also used"),
    ([[S(group_id=True)]], r"output\[0\]\[0\]: group_id=True is a bool"),
    ([[S(group_id=2.0)]], r"group_id=2.0 is a float"),
    ([[[S()]], [[]], [[[]]]], r"output\[2\]\[0\]\[0\]: is a container at depth 3, deeper"),
])
def test_malformed_outputs_get_path_errors(bad, match):
    with pytest.raises(RolloutValidationError, match=match):
        flatten_rollout_output(bad)


def test_numpy_int_ids_become_ints():
    flat = flatten_rollout_output([[S(group_id=np.int64(4)), S(group_id=np.int64(4))]])
    assert flat.group_ids == (4, 4) and type(flat.group_ids[0]) is int


def test_loss_mask_normalisation():
    assert normalized_loss_mask(S(tokens=[1, 2, 3], response_length=2)).tolist() == [1, 1]
    assert normalized_loss_mask(S(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1],
                                  remove_sample=True)).tolist() == [0, 0]
    assert normalized_loss_mask(S(tokens=[1, 2, 3], response_length=2,
                                  loss_mask=[0, 1])).tolist() == [0, 1]
    with pytest.raises(RolloutValidationError, match=r"output\[0\]\[1\]: len\(loss_mask\)=3 but "
                                                     r"response_length=2"):
        normalized_loss_mask(S(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1, 1]),
                             "output[0][1]")
    with pytest.raises(RolloutValidationError, match=r"0/1 values, got \[0, 2\]"):
        normalized_loss_mask(S(tokens=[1, 2, 3], response_length=2, loss_mask=[0, 2]))


@pytest.mark.parametrize("sample, match", [
    (S(tokens=[1, 2, 3], response_length=2, loss_mask=[1], reward=1.0),
     r"output\[0\]\[1\]: len\(loss_mask\)=1 but response_length=2"),
    (S(tokens=[1, 2.5, 3], response_length=1, reward=1.0),
     r"output\[0\]\[1\]: tokens hold 2.5, not integer token ids"),
    (S(tokens=[1, "a"], response_length=1, reward=1.0), r"output\[0\]\[1\]: tokens hold 'a'"),
    (S(tokens=[1, -4], response_length=1, reward=1.0), r"output\[0\]\[1\]: token id -4"),
    (S(tokens=[1, 2], response_length=-1, reward=1.0),
     r"output\[0\]\[1\]: response_length=-1 is not a non-negative integer"),
    (S(tokens=[1, 2], response_length=3, reward=1.0), r"response_length=3 exceeds len\(tokens\)=2"),
    (S(tokens=[], response_length=0, reward=1.0), r"output\[0\]\[1\]: tokens=\[\] is not"),
    (S(tokens=[1, 2], response_length=1, reward=1.0, loss_mask=[3]),
     r"output\[0\]\[1\]: loss_mask"),
    (S(tokens=[1, 2], response_length=1, reward=1.0, status="done"), r"output\[0\]\[1\].status"),
    (S(tokens=[1, 2], response_length=1, reward=1.0, rollout_log_probs=[-1.0]),
     r"output\[0\]\[1\]: rollout_log_probs is set but output\[0\]\[0\] has it None"),
    (S(tokens=[1, 2], response_length=1, reward=1.0, index=-2), r"index=-2"),
    (S(tokens=[1, 2], response_length=1, reward=1.0, remove_sample=1), r"remove_sample=1"),
    (S(tokens=[1, 2], response_length=1, reward=1.0, weight_versions=3),
     r"output\[0\]\[1\]: weight_versions=3 is a int, not a list"),
    (S(tokens=[1, 2], response_length=1, reward=1.0, weight_versions=[1, -1]),
     r"output\[0\]\[1\]: weight_versions holds -1, not a weight version"),
    (S(tokens=[1, 2], response_length=1, reward=1.0, weight_versions=[2, True]),
     r"weight_versions holds True"),
    (S(tokens=[1, 2], response_length=1, reward=1.0, weight_versions=[4, 2]),
     r"output\[0\]\[1\]: weight_versions=\[4, 2\] decreases"),
])
def test_bad_samples_are_named_by_path_in_from_samples(sample, match):
    good = S(tokens=[7, 8], response_length=1, reward=0.0)
    with pytest.raises(RolloutValidationError, match=match):
        RolloutBatch.from_samples([[good, sample]])


def test_opd_reverse_kl_is_any_finite_real_not_a_log_prob():
    """Top-k distillation's reverse-KL estimates may be positive or negative, one per response
    token, all samples or none; a non-finite one is named as an estimate, not a log-prob."""
    def kl(*values):
        return S(tokens=[1, 2, 3], response_length=2, reward=1.0, opd_reverse_kl=list(values))

    batch = RolloutBatch.from_samples([[kl(2.5, -0.75), kl(0.0, 1e6)]])
    assert batch.opd_reverse_kl.tolist() == [2.5, -0.75, 0.0, 1e6]
    assert batch.teacher_log_probs is None and batch.rollout_log_probs is None
    with pytest.raises(RolloutValidationError, match=r"output\[0\]\[1\]: opd_reverse_kl holds "
                       r"nan\. Fix: reverse-KL estimates must be finite"):
        RolloutBatch.from_samples([[kl(1.0, 2.0), kl(1.0, float("nan"))]])
    with pytest.raises(RolloutValidationError, match=r"len\(opd_reverse_kl\)=1 but response"):
        RolloutBatch.from_samples([[kl(1.0)]])
    with pytest.raises(RolloutValidationError, match=r"opd_reverse_kl is set but"):
        RolloutBatch.from_samples([[S(tokens=[7, 8], response_length=1, reward=0.0),
                                    kl(1.0, 2.0)]])
    with pytest.raises(RolloutBatchError, match=r"opd_reverse_kl\[1\]=-inf breaks the rule: "
                       r"reverse-KL estimates are finite"):
        attrs.evolve(batch, opd_reverse_kl=np.array([0, -np.inf, 0, 0], dtype=np.float32))


def test_empty_output_is_an_error():
    with pytest.raises(RolloutValidationError, match="no samples"):
        RolloutBatch.from_samples([[], ()])
