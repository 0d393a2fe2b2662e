"""Real multi-process gloo tests of the loss/metric collectives (spawned, OMP_NUM_THREADS=1).

One spawned 4-process world (imports cost seconds per process on 2 cores) runs every
(dp, cp) layout in {(1,1), (2,1), (1,2), (2,2), (4,1), (1,4)} on sub-groups, for every loss
mode and for the GSPO and CISPO surrogates (GSPO's sequence ratio reduced over the real CP
group): a tiny model's backward through the real all-reduce must equal the single-process
reference to 1e-6; all-reduced step sums and gathered metrics must equal single-process
values; and gather destinations must follow the group, with groups {0,1} and {2,3}.
"""


import pytest

from tests.shell.gloo_loss_worker import LAYOUTS, SURROGATES, worker
from tests.shell.gloo_world import spawn_world
from vime_pure import LossMode

pytestmark = pytest.mark.slow
WORLD = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    results = spawn_world(worker, WORLD, tmp_path_factory.mktemp("gloo"), "gloo")
    layouts = results[0]["layouts"].values()
    print("\n[gloo] max deviations vs single process: " + ", ".join(
        f"{k}={max(r[k] for r in layouts):.2e}" for k in ("grad_dev", "report_dev", "metric_dev")))
    return results


@pytest.mark.parametrize("dp, cp", LAYOUTS)
def test_gradient_through_real_all_reduce_matches_single_process(results, dp, cp):
    for mode in LossMode:
        res = results[0]["layouts"][f"{dp}x{cp}:{mode.value}"]
        assert res["grad_norm"] > 1e-3, "reference gradient should not be trivially zero"
        assert res["grad_dev"] <= 1e-6, (mode, res)


@pytest.mark.parametrize("dp, cp", LAYOUTS)
def test_step_report_and_gathered_metrics_match_single_process(results, dp, cp):
    for mode in LossMode:
        res = results[0]["layouts"][f"{dp}x{cp}:{mode.value}"]
        assert res["report_dev"] <= 1e-6, (mode, res)
        assert res["metric_dev"] <= 1e-6, (mode, res)


@pytest.mark.parametrize("surrogate", SURROGATES)
@pytest.mark.parametrize("dp, cp", LAYOUTS)
def test_gspo_and_cispo_under_any_layout_match_single_process(results, dp, cp, surrogate):
    """GSPO's whole-sample ratio under CP (each CP rank holds a zigzag slice of every
    sample): the CP ranks' losses and gradients add up to the unsplit step's."""
    res = results[0]["layouts"][f"{dp}x{cp}:{surrogate}"]
    assert res["grad_norm"] > 1e-3
    assert res["grad_dev"] <= 1e-6 and res["report_dev"] <= 1e-6, res


def test_only_the_group_source_receives_the_reduction(results):
    """Layout results exist only on global rank 0 (the source of every layout group)."""
    assert all(not r["layouts"] for r in results[1:])


def test_gather_lands_on_each_groups_source_rank(results):
    gathers = [r["gather"] for r in results]
    assert [g["source"] for g in gathers] == [0, 0, 2, 2]
    assert gathers[0]["gathered"] == {"r": 0.5}  # ranks 0, 1 -> mean of 0 and 1
    assert gathers[2]["gathered"] == {"r": 2.5}  # ranks 2, 3, on global rank 2
    assert gathers[1]["gathered"] is None and gathers[3]["gathered"] is None
    # torch itself: dst=2 (global) and group_dst=0 (group-relative) reach the same rank.
    assert gathers[2]["raw"] == [2, 3, 20, 30] and gathers[3]["raw"] is None


def test_mismatched_step_sum_keys_raise_on_every_rank(results):
    for r in (2, 3):
        message = results[r]["gather"]["mismatch"]
        assert message is not None and "extra" in message and "Fix:" in message
