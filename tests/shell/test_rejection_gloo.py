"""``--use-rs`` on shares, over a real 4-process gloo world: each DP rank judges the samples
it trains, its CP ranks complete their old log-probs between them, and the records equal the
core's rejection of the whole batch (masks and denominators exactly, ``rejected_token_frac``
to float rounding), for every level and denominator at DP x CP = 4x1, 2x2 and 1x4. CP does
not run in the CPU trainer (``docs/large-models.md``), so this is where the CP path of
``share_log_probs`` runs. The MIS weights (``--tis-function mis``) likewise: every rank's
records carry the weights the core gives the whole batch, batch-normalized step by step with
the DP ranks' sums, and mode mask's rejection."""

import pytest

from tests.shell.gloo_world import spawn_world
from tests.shell.rejection_worker import LAYOUTS, LEVELS, MIS_CONFIGS, worker

pytestmark = pytest.mark.slow
WORLD = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_world(worker, WORLD, tmp_path_factory.mktemp("rejection"), "rejection")


@pytest.mark.parametrize("dp, cp", LAYOUTS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("denominator", ["original", "surviving"])
def test_share_rejection_equals_the_whole_batch_rejection(results, dp, cp, level, denominator):
    key = f"{dp}x{cp}:{level}:{denominator}"
    for rank, res in enumerate(results):
        assert "error" not in res, res.get("error")
        got = res[key]
        assert got["unfilled"] == 0, (rank, got)  # every share token completed over CP
        assert got["wrong_masks"] == 0 and got["wrong_dens"] == 0, (rank, got)
        assert got["frac"] == pytest.approx(got["want_frac"], rel=1e-12), (rank, got)
        assert got["rejected_tokens"] > 0  # the band rejects something: the test bites


@pytest.mark.parametrize("dp, cp", LAYOUTS)
@pytest.mark.parametrize("level", LEVELS)
def test_share_mis_weights_equal_the_whole_batch_weights(results, dp, cp, level):
    for rank, res in enumerate(results):
        assert "error" not in res, res.get("error")
        got = res[f"mis:{dp}x{cp}:{level}"]
        assert got["steps"] == 3  # normalization per step, over the DP ranks' sums
        assert got["wrong_weights"] == 0 and got["wrong_masks"] == 0, (rank, got)
        assert got["before"] == pytest.approx(got["want_before"], rel=1e-12), (rank, got)
        assert got["spread"] > 0.05  # the weights differ between tokens: the test bites
    assert MIS_CONFIGS[level].level == level
