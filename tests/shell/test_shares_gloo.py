"""The sharded rollout path end to end on gloo: no rank-0 funnel, the same numbers.

``share_fixture.json`` holds ``metrics.jsonl`` of the same runs made by the funnel the sharded
path replaced (engine leaders pickled their samples to rank 0, which built the batch and
broadcast it), recorded on main's sources before the merge (``share_workers.py``; the fan-out
keys ``samples_per_group_*`` came later and were derived from its own counts). The sharded
runs must give those values (``tests.metric_keys``): token, sample, group and prompt counts,
lengths, rewards and fractions exactly; the trainer's floats (loss, entropy, grad norm, ...)
to rounding, as the fixture was recorded on another machine; and the keys computed from the
engine's log-probs (``logprob_gap``, ``mismatch_*``) to float noise, since the engines batched
other prompts together than the fixture's (chunks of a work queue, not contiguous blocks). At
world 2 (DP 2) and world 4 (DP 2 x PP 2: PP peers receive the same share); and every rank must
receive its own share's bytes, not the batch's. In dp2 engine 1 is a straggler and must claim
fewer prompts, the data keys still bit-identical.
"""

import json

import pytest

from tests.metric_keys import assert_metrics_match
from tests.shell.share_workers import FIXTURE, RUNS, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("embedded"))


@pytest.mark.parametrize("name", list(RUNS))
def test_sharded_queued_runs_give_the_funnels_metrics_and_move_only_shares(tmp_path, cache, name):
    out = run(name, str(tmp_path), cache)
    # Not ``==``: the engine log-prob keys are noise of the engines' batches (see the docstring).
    assert_metrics_match(out[0]["metrics"], json.loads(FIXTURE.read_text())[name])
    world = RUNS[name][0]
    for rank, o in enumerate(out):
        assert len(o["moved"]) == 2  # one per rollout
        for m in o["moved"]:
            got, share, n = m["stats"]["share_received"], m["share_bytes"], m["share_samples"]
            # What arrives is this rank's share and nothing else: its arrays less what the
            # receiver rebuilds (offsets, advantages from the plan, int32 lengths: 28 B per
            # sample + 16), plus a 32-byte header per holder that sent a piece.
            packed = share - 28 * n - 16
            assert packed < got <= packed + 32 * world, (rank, m)
            if rank:
                assert m["stats"]["meta_received"] == 0  # only rank 0 gathers metadata
    assert world == len(out)
    claims = [c for o in out for c in o["claims"]]
    _check_claims(name, claims)
    # Every rank leads an engine: it is a holder, sending rank 0 its chunks' metadata, when its
    # engine claimed a chunk of that rollout (a fast engine may claim a slow one's share).
    for rank, o in enumerate(out[1:], start=1):
        for rid, m in enumerate(o["moved"]):
            claimed = any(c[0] == rank and c[1] == rid for c in claims)
            assert (m["stats"]["meta_sent"] > 0) == claimed, (rank, rid, claims)


def _check_claims(name: str, claims: list) -> None:
    """Per rollout every prompt was generated once, in chunks of 1 (4 prompts, >= 2 engines:
    ``queue_chunk_size``); in dp2 the straggler (engine 1, which starts a chunk only after
    engine 0 generated every other prompt: ``recorded_rollout``) claimed fewer prompts than
    engine 0, at any load."""
    for rid in (0, 1):
        mine = [(rank, first, n) for rank, r, first, n in claims if r == rid]
        assert sorted(first for _, first, _ in mine) == [0, 1, 2, 3] and all(
            n == 1 for *_, n in mine), mine
        per_rank = {r: sum(n for rank, _, n in mine if rank == r) for r in (0, 1)}
        assert name != "dp2" or per_rank[1] < per_rank[0], mine
