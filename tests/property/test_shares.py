"""The sharded batch (``vime_pure.data.shares``): metadata, plan, pieces and shares.

Properties: splitting any per-prompt rollout output into engine parts, merging their metadata
and planning gives the whole batch's advantages, group numbering and schedule; every DP rank's
share, assembled from the pieces each part cuts for it, builds records equal field by field to
``rank_batch`` on the whole batch, under every loss mode and CP size; a rank's share holds its
scheduled samples and nothing else.
"""

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.property.data_strategies import rollout_outputs, schedule_configs
from tests.property.test_shards import assert_same_batch
from vime_pure import (BatchingPolicy, ParallelLayout, RolloutBatch, Sample, ScheduleError,
                       rank_batch, schedule_for)
from vime_pure.data.microbatch import share_batch
from vime_pure.data.shards import merge_rollout_shares, prompt_shares
from vime_pure.data.held_parts import claimed_part, held_rows, join_parts
from vime_pure.data.batch import COLUMNS, OPTIONAL_COLUMNS
from vime_pure.data.shares import (META_COLUMNS, PRESENCE_FLAGS, BatchMeta, assemble_share,
                                   merge_meta, output_part, part_meta, plan_shares,
                                   share_piece)
from vime_pure.data.work_queue import (chunk_range, chunks_per_engine, in_prompt_order,
                                       queue_chunk_size)
from vime_pure.denominators import LossMode
from vime_pure.errors import RolloutBatchError, RolloutValidationError


@st.composite
def split_outputs(draw):
    """A per-prompt output (depth >= 1), cut into 1-3 engine parts by ``prompt_shares``
    (``(first prompt, output)`` pairs)."""
    output = list(draw(rollout_outputs(depth=draw(st.integers(1, 2)))))
    engines = draw(st.integers(1, 3))
    parts = [(s.start, output[s.start:s.stop]) for s in prompt_shares(len(output), engines)]
    return output, [p for p in parts if p[1]]


@st.composite
def claim_patterns(draw, num_prompts: int):
    """Work-queue claims of ``num_prompts`` prompts: a chunk size, and for every engine (1-3)
    the chunk starts it claimed, in claim (= increasing) order; any engine may claim any
    chunk, some none."""
    chunk = draw(st.integers(1, 3))
    engines = draw(st.integers(1, 3))
    owner = [draw(st.integers(0, engines - 1)) for _ in range(0, num_prompts, chunk)]
    return chunk, [[k * chunk for k, o in enumerate(owner) if o == e] for e in range(engines)]


def _plan(parts, layout, policy):
    pieces = [output_part(p, start=start) for start, p in parts]
    meta, plan = plan_shares(merge_meta([m for _, m in pieces]), layout, policy)
    return [b for b, _ in pieces], meta, plan


def _schedulable(data, whole):
    """A drawn layout and policy that can schedule ``whole``, and its schedule."""
    layout, policy = data.draw(schedule_configs(whole.num_groups))
    try:
        return layout, policy, schedule_for(whole, layout, policy)
    except ScheduleError:
        assume(False)
        raise


def _pieces(parts, plan, dp):
    """DP rank ``dp``'s pieces from every contiguous part (a part: one chunk)."""
    return [share_piece(b, plan, dp, starts=np.array([start])) for (start, _), b in parts]


def _records_equal(a, b) -> None:
    assert a.num_response_tokens == b.num_response_tokens
    assert len(a.steps) == len(b.steps)
    for sa, sb in zip(a.steps, b.steps):
        assert (sa.num_groups, sa.num_samples) == (sb.num_groups, sb.num_samples)
        for x, y in zip(sa.microbatches, sb.microbatches, strict=True):
            for f in attrs.fields(type(x)):
                u, v = getattr(x, f.name), getattr(y, f.name)
                if isinstance(u, np.ndarray) or isinstance(v, np.ndarray):
                    np.testing.assert_array_equal(u, v, err_msg=f.name)
                else:
                    assert u == v, f.name


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(split_outputs(), st.data())
def test_shares_build_the_whole_batch_records(case, data):
    """Theorem: metadata carry every number the schedule, the advantages and the records
    need, and a share carries exactly its rank's samples, so the sharded path equals the
    whole-batch path bit for bit (merged output -> one batch -> rank_batch)."""
    output, parts = case
    whole = RolloutBatch.from_samples(merge_rollout_shares([p for _, p in parts]))
    layout, policy, schedule = _schedulable(data, whole)
    batches, meta, plan = _plan(parts, layout, policy)
    assert plan.schedule == schedule
    np.testing.assert_array_equal(plan.part_starts, [s for s, _ in parts])
    assert meta.group_id_values == whole.group_id_values
    assert meta.prompt_group_values == whole.prompt_group_values
    np.testing.assert_array_equal(meta.advantages, whole.advantages)
    np.testing.assert_array_equal(meta.mask_sums, whole.mask_sums)
    mode = data.draw(st.sampled_from(list(LossMode)))
    cp = data.draw(st.sampled_from([1, 2]))
    for dp in range(layout.dp):
        share = assemble_share(_pieces(list(zip(parts, batches)), plan, dp), plan, dp)
        ids = schedule.rank_sample_ids(dp)
        np.testing.assert_array_equal(share.sample_ids, ids)
        assert share.tokens.size == int(whole.lengths[ids].sum())  # its samples, nothing more
        for cp_rank in range(cp):
            kw = dict(dp_rank=dp, loss_mode=mode, cp_size=cp, cp_rank=cp_rank, norm=8.0)
            _records_equal(share_batch(share, plan.schedule, plan.mask_sums, **kw),
                           rank_batch(whole, schedule, **kw))


def test_none_ids_are_numbered_after_the_merge():
    """Two engines whose rollouts leave group ids None get the ids one merged output gets."""
    parts = [[[Sample(tokens=[1, 2], response_length=1, reward=1.0, group_id=0),
               Sample(tokens=[1, 3], response_length=1, reward=0.0)]],
             [[Sample(tokens=[4, 2], response_length=1, reward=1.0),
               Sample(tokens=[4, 3], response_length=1, reward=0.0, group_id=5)]]]
    whole = RolloutBatch.from_samples(merge_rollout_shares(parts))
    meta = merge_meta([output_part(p, start=s)[1] for s, p in enumerate(parts)])
    assert meta.group_id_values == whole.group_id_values == (0, 1, 2, 5)
    assert meta.prompt_group_values == whole.prompt_group_values


def test_each_execution_counts_its_tool_calls_once_over_its_leaves_and_parts():
    """Every leaf of an agent execution carries the execution's ``tool_calls``: a part counts
    each group once; the merge keeps the count per part; a part where no sample counts them
    makes the batch's count unknown (None), never 0."""
    def leaf(group: int, calls: int | None) -> Sample:
        meta = {} if calls is None else {"tool_calls": calls}
        return Sample(tokens=[1, 2], response_length=1, reward=1.0, group_id=group,
                      metadata=meta)

    agent = [[leaf(0, 2), leaf(0, 2), leaf(0, 2)], [leaf(1, 0)]]  # one prompt, 2 executions
    other = [[leaf(2, 1)]]
    metas = [output_part(agent, start=0)[1], output_part(other, start=1)[1]]
    assert [int(m.part_tool_calls[0]) for m in metas] == [2, 1]
    assert merge_meta(metas).part_tool_calls.tolist() == [2, 1]
    blind = output_part([[leaf(3, None)]], start=2)[1]
    assert blind.part_tool_calls is None
    assert merge_meta([*metas, blind]).part_tool_calls is None


def test_an_explicit_id_in_two_parts_is_an_error():
    parts = [[[Sample(tokens=[1, 2], response_length=1, reward=1.0, group_id=7)]],
             [[Sample(tokens=[3, 2], response_length=1, reward=1.0, group_id=7)]]]
    with pytest.raises(RolloutValidationError, match=r"^group_id=7: is used by the outputs of "
                                                     r"two engines or prompt chunks \(the ones "
                                                     r"from prompt 0 and from prompt 1\)"):
        merge_meta([output_part(p, start=s)[1] for s, p in enumerate(parts)])


def test_a_chunk_held_twice_is_an_error():
    part = [[Sample(tokens=[1, 2], response_length=1, reward=1.0)]]
    with pytest.raises(RolloutValidationError, match=r"^prompt chunk=3: is held by two parts"):
        merge_meta([output_part(part, start=3)[1], output_part(part, start=3)[1]])


def test_a_missing_piece_is_a_typed_error():
    parts = [[[Sample(tokens=[1, 2, 3], response_length=2, reward=float(i), group_id=i)]]
             for i in range(2)]
    parts = list(enumerate(parts))
    batches, _, plan = _plan(parts, ParallelLayout(dp=1),
                             BatchingPolicy(global_batch_size=2, max_tokens_per_gpu=100))
    with pytest.raises(RolloutBatchError, match="first missing: \\[1\\]"):
        assemble_share([share_piece(batches[0], plan, 0, starts=np.array([0]))], plan, 0)
    with pytest.raises(RolloutBatchError, match=r"^starts=\[5\]: name chunks the plan"):
        share_piece(batches[0], plan, 0, starts=np.array([5]))


@settings(max_examples=15)
@given(split_outputs())
def test_joined_parts_are_the_merged_batch(case):
    """Theorem: the parts concatenated with the merged ids and advantages are the batch of the
    merged output (what dumps and the test hook read)."""
    _, parts = case
    whole = RolloutBatch.from_samples(merge_rollout_shares([p for _, p in parts]))
    pieces = [output_part(p, start=s) for s, p in parts]
    meta, _ = plan_shares(merge_meta([m for _, m in pieces]),
                          ParallelLayout(dp=1), BatchingPolicy(global_batch_size=1,
                                                               max_tokens_per_gpu=10**6,
                                                               allow_partial_step=True))
    assert_same_batch(join_parts([b for b, _ in pieces], meta), whole)


def _same_share(a, b) -> None:
    for f in attrs.fields(type(a)):
        u, v = getattr(a, f.name), getattr(b, f.name)
        assert (u is None) == (v is None), f.name
        if u is not None:
            np.testing.assert_array_equal(u, v, err_msg=f.name)


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(split_outputs(), st.data())
def test_any_claim_pattern_gives_the_contiguous_blocks_batch(case, data):
    """Theorem: a chunk's samples depend only on its prompts, and rank 0 merges chunks at their
    first prompt, so whichever engine claimed which chunk (and in whatever order holders
    report) the merged metadata, the plan's schedule and every rank's share equal the
    contiguous blocks' bit for bit, and the joined parts are the whole batch."""
    output, blocks = case
    chunk, claims = data.draw(claim_patterns(len(output)))
    held = [claimed_part([(s, output[s:s + chunk]) for s in starts]) for starts in claims]
    held = [(b, m) for b, m in held if b is not None]
    whole = RolloutBatch.from_samples(output)
    layout, policy, schedule = _schedulable(data, whole)
    block_batches, block_meta, block_plan = _plan(blocks, layout, policy)
    metas = [m for _, ms in held for m in ms]
    order = data.draw(st.permutations(range(len(metas))))
    meta, plan = plan_shares(merge_meta([metas[i] for i in order]), layout, policy)
    assert plan.schedule == block_plan.schedule == schedule
    for name in ("lengths", "response_lengths", "mask_sums", "group_ids", "prompt_groups",
                 "rewards", "statuses", "advantages", "weight_version_min"):
        np.testing.assert_array_equal(getattr(meta, name), getattr(block_meta, name), name)
    assert meta.group_id_values == block_meta.group_id_values == whole.group_id_values
    assert meta.prompt_group_values == block_meta.prompt_group_values
    assert int(meta.part_outputs.sum()) == len(output)
    for dp in range(layout.dp):
        got = assemble_share([share_piece(b, plan, dp, starts=np.concatenate(
            [m.part_starts for m in ms])) for b, ms in held], plan, dp)
        ref = assemble_share(_pieces(list(zip(blocks, block_batches)), block_plan, dp),
                             block_plan, dp)
        _same_share(got, ref)
    joined = join_parts([b for b, _ in held], meta, rows=held_rows([ms for _, ms in held]))
    assert_same_batch(joined, whole)


def test_chunks_and_claims():
    """The documented examples: 4 claims per engine (1 where calls are tail-bound), the end
    is an empty range."""
    assert queue_chunk_size(64, 4) == 4 and queue_chunk_size(3, 8) == 1
    assert queue_chunk_size(0, 2) == 1 and queue_chunk_size(10, 2, per_engine=1) == 5
    assert chunks_per_engine(tail_bound=True) == 1 and chunks_per_engine(tail_bound=False) == 4
    assert chunk_range(2, 4, 10) == range(8, 10) and chunk_range(3, 4, 10) == range(10, 10)
    assert in_prompt_order([(4, "b"), (0, "a")]) == ["a", "b"]
    with pytest.raises(RolloutValidationError, match="^num_engines=0: must be an integer"):
        queue_chunk_size(4, 0)


def test_metadata_columns_are_the_batchs_own_declared_once():
    """``META_COLUMNS`` is the one declaration: every entry is a ``RolloutBatch`` column (or
    its derived ``mask_sums``) and a ``BatchMeta`` field, and a part's metadata holds exactly
    those arrays in those dtypes, the batch's values."""
    batch = RolloutBatch.from_samples([[Sample(tokens=[1, 2, 3], response_length=2,
                                               reward=1.0)]])
    meta = part_meta(batch)
    fields = {f.name for f in attrs.fields(type(meta))}
    for name, dtype in META_COLUMNS.items():
        assert name in fields and hasattr(batch, name)
        assert name in COLUMNS or name == "mask_sums"
        assert getattr(meta, name).dtype == dtype
        np.testing.assert_array_equal(getattr(meta, name), getattr(batch, name))


def test_metadata_with_a_column_in_another_dtype_or_length_is_a_typed_error():
    meta = part_meta(RolloutBatch.from_samples([[Sample(tokens=[1, 2], response_length=1,
                                                        reward=0.0)]]))
    with pytest.raises(RolloutBatchError, match=r"BatchMeta.rewards is float32"):
        attrs.evolve(meta, rewards=meta.rewards.astype(np.float32))
    with pytest.raises(RolloutBatchError, match=r"BatchMeta.statuses"):
        attrs.evolve(meta, statuses=np.zeros(2, np.uint8))


def test_each_optional_column_has_a_presence_flag_the_parts_agree_on():
    """``PRESENCE_FLAGS`` names a ``BatchMeta`` flag for every optional batch column; a part
    recording top-k distillation's reverse-KL estimates merges only with parts that do too."""
    assert tuple(PRESENCE_FLAGS) == OPTIONAL_COLUMNS
    assert set(PRESENCE_FLAGS.values()) <= {f.name for f in attrs.fields(BatchMeta)}
    _, with_kl = output_part([[Sample(tokens=[1, 2], response_length=1, reward=1.0,
                                      opd_reverse_kl=[-0.5])]])
    _, without = output_part([[Sample(tokens=[3, 4], response_length=1, reward=0.0)]], start=1)
    assert with_kl.has_opd_reverse_kl and not without.has_opd_reverse_kl
    assert merge_meta([with_kl, attrs.evolve(without, has_opd_reverse_kl=True)]
                      ).has_opd_reverse_kl
    with pytest.raises(RolloutValidationError, match="^opd_reverse_kl are recorded by some"):
        merge_meta([with_kl, without])
