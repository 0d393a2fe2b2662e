"""Fuzz: the rollout data model's entry points: ``Sample`` (+ ``RolloutBatch.from_samples``),
the ``RolloutBatch`` and ``TrainMicroBatch`` constructors on corrupted columns, ``rank_batch``,
``with_log_probs`` and the advantage functions.

Success must give records that pass the independent invariant checks of
``tests/data_invariants.py``; failure a ``VimeError``.
"""

import attrs
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.data_invariants import assert_microbatch_invariants, assert_rolloutbatch_invariants
from tests.fuzz.harness import REJECTED, no_nan, outcome
from tests.fuzz.strategies import (BAD_REALS, GROUP_ID, JUNK, bad_id_lists, bad_ints, counts,
                                   good_ints, good_reals, id_lists, mostly, one_bad, or_junk)
from tests.property.data_strategies import rollout_outputs, samples, scheduled_batches
from vime_pure import (LOSS_MODES, LossMode, RewardNormalization, RolloutBatch, Sample,
                       TrainMicroBatch, check_token_ids, normalize_rewards, rank_batch,
                       with_log_probs)

SAMPLE_FIELDS = {
    "tokens": or_junk(st.lists(st.integers(-1, 2**40), min_size=1, max_size=5)),
    "response_length": counts(0, 3),
    "loss_mask": st.one_of(st.none(), st.lists(st.sampled_from([0, 1, 0.5, 2, True]),
                                               max_size=4), st.just("11"), st.just(1), JUNK),
    "reward": st.one_of(st.floats(-1, 1), st.floats(allow_nan=True),
                        st.dictionaries(st.sampled_from(["r", "s"]), st.floats(-1, 1)), JUNK),
    "status": or_junk(st.sampled_from(["completed", "truncated", "aborted"])),
    "group_id": GROUP_ID, "prompt_group": GROUP_ID, "index": st.none() | counts(0, 9),
    "rollout_log_probs": st.one_of(st.none(), st.lists(st.floats(-5, 0), max_size=4), JUNK),
    "remove_sample": or_junk(st.booleans()),
}


@st.composite
def fuzzed_outputs(draw):
    """A rollout output whose samples have some fields replaced by fuzzed values."""
    output = draw(rollout_outputs(light=True, max_prompts=3))
    flat = []

    def walk(node):
        for child in node:
            (flat.append(child) if isinstance(child, Sample) else walk(child))

    walk(output)
    for sample in draw(st.lists(st.sampled_from(flat), max_size=2)):
        for name in draw(st.lists(st.sampled_from(sorted(SAMPLE_FIELDS)), max_size=2)):
            setattr(sample, name, draw(SAMPLE_FIELDS[name]))
    return draw(or_junk(st.just(output)))


@given(fuzzed_outputs(), or_junk(st.sampled_from([None, None, "r"])))
def test_rollout_batch_from_samples(output, reward_key):
    batch = outcome("RolloutBatch.from_samples", RolloutBatch.from_samples, output,
                    reward_key=reward_key)
    if batch is not REJECTED:
        assert_rolloutbatch_invariants(batch)


@st.composite
def sample_dicts(draw):
    """``Sample.to_dict()`` of a valid sample; half the time one value fuzzed, an unknown key
    added, or something else than a dict."""
    data = draw(samples()).to_dict()
    kind = draw(st.sampled_from(["ok", "ok", "ok", "value", "key", "junk"]))
    if kind == "value":
        name = draw(st.sampled_from(sorted(SAMPLE_FIELDS)))
        data[name] = draw(SAMPLE_FIELDS[name])
    elif kind == "key":
        data[draw(st.one_of(st.text(max_size=3), st.integers(), st.none()))] = 1
    elif kind == "junk":
        return draw(JUNK)
    return data


@given(sample_dicts())
def test_sample_from_dict(data):
    sample = outcome("Sample.from_dict", Sample.from_dict, data)
    if sample is not REJECTED:
        assert isinstance(sample, Sample)
        batch = outcome("RolloutBatch.from_samples", RolloutBatch.from_samples, [[sample]])
        if batch is not REJECTED:
            assert_rolloutbatch_invariants(batch)


def _corrupt(draw, arr):
    """One corruption of a column: a bad value, a wrong dtype, a missing or extra entry."""
    kind = draw(st.sampled_from(["value", "dtype", "short", "long", "junk"]))
    if kind == "value" and arr is not None and arr.size:
        out = arr.copy()
        value = draw(st.sampled_from([-1, 2, 10**6, float("nan"), -float("inf")]))
        if out.dtype.kind in "iub" and not float(value).is_integer():
            value = -1
        out[draw(st.integers(0, arr.size - 1))] = np.asarray(value).astype(out.dtype)
        return out
    if kind == "dtype" and arr is not None:
        return arr.astype(draw(st.sampled_from([np.int32, np.float64, np.int64, np.uint8])))
    if kind == "short" and arr is not None:
        return arr[:-1]
    if kind == "long" and arr is not None:
        return np.concatenate([arr, arr[:1]])
    return draw(JUNK)


@given(scheduled_batches(), st.data())
def test_rollout_batch_constructor(case, data):
    batch, _ = case
    fields = {f.name: getattr(batch, f.name) for f in attrs.fields(RolloutBatch) if f.init}
    name = data.draw(st.sampled_from(sorted(fields)))
    fields[name] = _corrupt(data.draw, fields[name]) if isinstance(
        fields[name], np.ndarray) or fields[name] is None else data.draw(
        st.one_of(JUNK, st.just(fields[name][:-1]), st.just(list(fields[name]))))
    rebuilt = outcome("RolloutBatch", RolloutBatch, **fields)
    if rebuilt is not REJECTED:
        assert_rolloutbatch_invariants(rebuilt)


@given(scheduled_batches(), one_bad({"loss_mode": st.sampled_from(LOSS_MODES),
                                     "dp_rank": good_ints(0, 0), "cp_size": good_ints(1, 2),
                                     "cp_rank": good_ints(0, 0),
                                     "norm": st.none() | good_reals(1, 9)},
                                    {"loss_mode": st.text(max_size=3) | JUNK,
                                     "dp_rank": bad_ints(0), "cp_size": bad_ints(1),
                                     "cp_rank": bad_ints(0), "norm": BAD_REALS}),
       mostly(st.just(False), st.just(True)))
@settings(max_examples=100)  # each example builds a batch and every rank's records
def test_rank_batch(case, kwargs, other_batch):
    batch, schedule = case
    if other_batch:  # a schedule planned for another batch must be refused
        batch = RolloutBatch.from_samples([[Sample(tokens=[1, 2], response_length=1,
                                                   reward=0.0)]])
    records = outcome("rank_batch", rank_batch, batch, schedule, **kwargs)
    if records is REJECTED:
        return
    mode, norm, cp = kwargs["loss_mode"], kwargs["norm"], int(kwargs["cp_size"])
    ranks = {(d, c): rank_batch(batch, schedule, dp_rank=d, loss_mode=mode, cp_size=cp,
                                cp_rank=c, norm=norm)
             for d in range(schedule.layout.dp) for c in range(cp)}
    assert_microbatch_invariants(ranks, batch, schedule, LossMode.parse(mode),
                                 None if norm is None else float(norm))


@given(scheduled_batches(), st.data())
@settings(max_examples=100)
def test_train_microbatch_and_log_probs(case, data):
    batch, schedule = case
    ranks = rank_batch(batch, schedule, dp_rank=0)
    record = ranks.microbatches[0]
    fields = {f.name: getattr(record, f.name) for f in attrs.fields(TrainMicroBatch)}
    name = data.draw(st.sampled_from(sorted(fields)))
    value = fields[name]
    fields[name] = _corrupt(data.draw, value) if isinstance(value, np.ndarray) or value is None \
        else data.draw(or_junk(counts(0, 4)))
    rebuilt = outcome("TrainMicroBatch", TrainMicroBatch, **fields)
    if rebuilt is not REJECTED:
        k = len(rebuilt.sample_indices)
        assert ((rebuilt.token_sample >= 0) & (rebuilt.token_sample < k)).all()
        assert set(rebuilt.loss_mask.tolist()) <= {0.0, 1.0}
        no_nan(rebuilt.denominators)
    logps = data.draw(st.one_of(
        st.just(np.zeros(ranks.num_response_tokens)), st.just(np.zeros(3, dtype=np.int64)),
        st.just(np.full(ranks.num_response_tokens, np.nan)), JUNK))
    attached = outcome("with_log_probs", with_log_probs, ranks, old_log_probs=logps)
    if attached is not REJECTED:
        for mb in attached.microbatches:
            assert mb.old_log_probs is None or not np.isnan(mb.old_log_probs).any()


@st.composite
def reward_inputs(draw):
    n = draw(st.integers(0, 8))
    return draw(one_bad({"rewards": st.lists(st.floats(-10, 10), min_size=n, max_size=n),
                         "group_ids": st.just(list(range(n))) | id_lists(n),
                         "prompt_groups": st.just([0] * n) | id_lists(n)},
                        {"rewards": st.lists(st.floats(allow_nan=True), min_size=n, max_size=n)
                         | st.just([1e308] * n) | JUNK,
                         "group_ids": bad_id_lists(n), "prompt_groups": bad_id_lists(n)}))


@given(reward_inputs(), mostly(st.sampled_from(["grpo", "gspo", "reinforce_pp_baseline"]),
                              st.text(max_size=3) | JUNK), or_junk(st.booleans()))
def test_normalize_rewards(case, method, normalize_std):
    config = outcome("RewardNormalization", RewardNormalization, method=method,
                     normalize_std=normalize_std)
    if config is REJECTED:
        return
    adv = outcome("normalize_rewards", normalize_rewards, **case, config=config)
    if adv is not REJECTED:
        no_nan(adv)
        assert np.isfinite(adv).all() and len(adv) == len(case["rewards"])


@given(rollout_outputs(), or_junk(st.one_of(st.integers(-2, 300), st.just(2**40))))
def test_check_token_ids(output, vocab):
    batch = RolloutBatch.from_samples(output)
    result = outcome("check_token_ids", check_token_ids, batch, vocab)
    if result is not REJECTED:  # passed: every id is a row of the embedding
        assert int(batch.tokens.min(initial=0)) >= 0 and int(batch.tokens.max(initial=0)) < vocab
