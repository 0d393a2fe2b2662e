"""The bytes of each rollout batch every trainer rank receives, in every mode, against the
core's bound: the batch's metadata plus the rank's own share (``vime_pure.data.share_bytes``;
issue 32, "one batch shape: parts everywhere").

Two gloo jobs of ``benchmarks.bytes_per_rank`` (2 trainer ranks, DP 2, 2 rollouts per mode):
world 2 colocated (the sharded exchange; with ``--save-rollout-data``, dumped where the parts
are; with a dynamic-sampling filter; with slime's rollout-log hook, which is handed the
samples) and world 4 with engines on 2 ranks of their own (synchronous, one step off, fully
async). Asserts: colocated, with dumps and with the filter, and in every mode with separate
engine ranks (the engine leaders, or the pools, keep their parts and send each trainer rank
its share over the span), every rank receives at most its bound, and rank 0 only metadata
from the holders; with the rollout-log hook, whose contract gives it every sample on rank
0, rank 0 receives the batch itself (the leaders' gather) while the other trainer ranks
still receive only the plan and their share. The counters are the ones production runs keep
(the bridge's pickled payloads per kind, ``ExchangeStats``), so weights and probes are
checked apart."""

import pytest

from benchmarks.bytes_per_rank import measure, rank_bytes

pytestmark = pytest.mark.slow

SEPARATE = ("sync", "one_step_off", "fully_async")
ROLLOUTS = 2  # one step off receives batch 1 while rollout 0 trains: 2 show it


@pytest.fixture(scope="module")
def colocated(tmp_path_factory, embedded_cache):
    return measure(("colocated", "colocated_dumps", "colocated_filter", "colocated_log"),
                   str(tmp_path_factory.mktemp("co")),
                   embedded_cache,
                   ROLLOUTS)


@pytest.fixture(scope="module")
def separate(tmp_path_factory, embedded_cache):
    return measure(SEPARATE, str(tmp_path_factory.mktemp("sep")), embedded_cache, ROLLOUTS)


def _bytes(ranks) -> list[list[dict]]:
    assert len(ranks) == 2 and all(len(r) == ROLLOUTS for r in ranks)  # 2 trainer ranks
    return [[rank_bytes(r, rank) for r in records] for rank, records in enumerate(ranks)]


def test_colocated_ranks_receive_at_most_metadata_and_their_own_share(colocated):
    ranks = colocated["colocated"]
    for rank, records in enumerate(_bytes(ranks)):
        for b in records:
            assert 0 < b["received"] <= b["bound"], (rank, b)
    for raw in ranks[1]:
        assert raw["exchange"]["meta_received"] == 0  # only rank 0 gathers metadata
    for raw in ranks[0] + ranks[1]:  # no sample is gathered: the leaders' verdicts only
        assert 0 < raw["transfers"]["received"]["batch"] < raw["batch"] / 20


def test_a_dynamic_sampling_filter_judges_where_the_groups_are(colocated):
    """24 groups judged per rollout, 16 kept: the leaders exchange verdicts (batch bytes of
    the transfers) and cut where the groups are; every rank stays within its bound, and
    rank 0 receives no sample in a gather."""
    ranks = colocated["colocated_filter"]
    for rank, records in enumerate(_bytes(ranks)):
        for b in records:
            assert 0 < b["received"] <= b["bound"], (rank, b)
    for raw in ranks[0] + ranks[1]:
        verdicts = raw["transfers"]["received"]["batch"]
        assert 0 < verdicts < raw["batch"] / 4  # verdicts, not samples


def test_dumps_are_written_where_the_parts_are(colocated):
    """``--save-rollout-data``: each leader writes its part, rank 0 the index; no rank
    receives more than its bound, and no sample is gathered (only the leaders' verdicts,
    as without dumps)."""
    ranks = colocated["colocated_dumps"]
    for rank, records in enumerate(_bytes(ranks)):
        for b in records:
            assert 0 < b["received"] <= b["bound"], (rank, b)
    for raw in ranks[0] + ranks[1]:  # no sample is gathered: the leaders' verdicts only
        assert 0 < raw["transfers"]["received"]["batch"] < raw["batch"] / 20


def test_slimes_rollout_log_hook_is_handed_the_batch_on_rank_0(colocated):
    """``--custom-rollout-log-function-path``: the hook receives the samples, so engine 1's
    outputs reach rank 0 in the leaders' gather (engine 1 generates all but one chunk); rank 1
    still receives only the plan and its share."""
    ranks = colocated["colocated_log"]
    first, second = _bytes(ranks)
    for raw, mine, b in zip(ranks[0], first, second):
        gathered = raw["transfers"]["received"]["batch"]
        assert gathered > raw["batch"] / 2  # 15 of 16 prompts' samples, pickled
        assert mine["received"] >= gathered + raw["exchange"]["share_received"]
        assert b["received"] <= b["bound"]
    for raw in ranks[1]:
        assert raw["transfers"]["sent"]["batch"] > 0 and raw["exchange"]["meta_received"] == 0


@pytest.mark.parametrize("mode", SEPARATE)
def test_engine_leaders_send_every_trainer_rank_only_its_share(separate, mode):
    """Engines on ranks of their own, in every mode: the engine leaders (the pools, fully
    async) keep their parts and send each trainer rank its share over the span; trainer
    rank 0 receives the metadata and its share, the bridge carries statistics, group keys
    and weights only."""
    ranks = separate[mode]
    for rank, records in enumerate(_bytes(ranks)):
        for b in records:
            assert 0 < b["received"] <= b["bound"], (mode, rank, b)
    for raw in ranks[0]:
        assert raw["transfers"]["received"]["batch"] == 0, mode  # no sample on the bridge
        assert raw["exchange"]["meta_received"] > 0  # the engine leaders' metadata
    for raw in ranks[0][:-1]:
        assert raw["transfers"]["sent"]["weights"] > 0
