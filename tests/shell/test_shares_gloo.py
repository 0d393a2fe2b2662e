"""The sharded rollout path end to end on gloo: no rank-0 funnel, the same numbers.

``share_fixture.json`` holds ``metrics.jsonl`` of the same runs made by the funnel the sharded
path replaced (engine leaders pickled their samples to rank 0, which built the batch and
broadcast it), recorded on main's sources before the merge (``share_workers.py``). The sharded
runs must give those values exactly (loss, reward, group and sample counts, entropy, grad
norm...: every key but wall-clock times), at world 2 (DP 2) and world 4 (DP 2 x PP 2: PP peers
receive the same share); and every rank must receive its own share's bytes, not the batch's.
"""

import json

import pytest

from tests.shell.share_workers import FIXTURE, RUNS, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("embedded"))


@pytest.mark.parametrize("name", list(RUNS))
def test_sharded_runs_give_the_funnels_metrics_and_move_only_shares(tmp_path, cache, name):
    out = run(name, str(tmp_path), cache)
    assert out[0]["metrics"] == json.loads(FIXTURE.read_text())[name]
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
    # Every rank leads an engine (a holder): it sends its part's metadata to rank 0.
    assert all(m["stats"]["meta_sent"] > 0 for o in out[1:] for m in o["moved"])
    assert world == len(out)
