"""Rollout routing replay (R3) on CPU: the HF engine's routes, carried by the batch, replayed
by Megatron's routers (runs in ``routing_workers``, on the shared 2-rank spawn)."""

import numpy as np
import pytest

from tests.shell.test_model_features import _delta

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(megatron_runs):
    return [megatron_runs["per_rank"][rank]["features_2"]["routing"] for rank in (0, 1)]


def test_the_engine_returns_one_route_per_token_and_layer(runs):
    run = runs[0]
    # Qwen3-MoE tiny model: 2 MoE layers, top-2; every prompt + response token is routed.
    assert {shape[1:] for shape in run["route_shapes"]} == {(2, 2)}
    assert [shape[0] for shape in run["route_shapes"]] == run["token_counts"]


def test_replaying_the_engines_routes_equals_free_routing_at_the_same_weights(runs):
    free, replay = runs[0]["free"], runs[0]["replay"]
    scored = np.isfinite(free["old"])
    assert np.array_equal(scored, np.isfinite(replay["old"]))
    # The log-prob pass and the first step run the weights that generated the rollout.
    assert float(np.max(np.abs(free["old"][scored] - replay["old"][scored]))) <= 1e-6
    assert abs(free["losses"][0] - replay["losses"][0]) <= 1e-7
    # After an update the routers would choose afresh; replay keeps the rollout's routes.
    assert free["losses"][1] != replay["losses"][1]


def test_given_routes_are_obeyed_in_every_router(runs):
    forced = runs[0]["forced"]
    # the log-prob pass: every router (2 layers) on every row of this rank
    assert len(forced["recorded"]) == len(forced["given"]) == 2 * forced["microbatches"]
    for (layer, chosen), given in zip(forced["recorded"], forced["given"]):
        assert np.array_equal(chosen, given), f"layer {layer}"
    assert _delta(forced["final"], runs[0]["replay"]["final"]) > 1e-5  # the routes act


def test_replay_under_recompute_and_expert_parallelism(runs):
    # Full recompute runs every router again in the backward: it replays the same routes.
    assert _delta(runs[0]["forced_recompute"]["final"], runs[0]["forced"]["final"]) == 0.0
    assert runs[0]["forced_recompute"]["losses"] == runs[0]["forced"]["losses"]
    # EP2 (experts split over the ranks) replays what DP2 does (EP tolerance, test_model_features)
    assert _delta(runs[0]["replay_ep2"]["final"], runs[0]["replay"]["final"]) <= 1e-5
    assert _delta(runs[0]["replay_ep2"]["final"], runs[1]["replay_ep2"]["final"]) == 0.0
