"""``vime train`` on a tiny Qwen3-MoE at DP2 and at EP2 with routing replay (2 gloo ranks, the
HF engine); see ``moe_loop_workers``. Tolerances: the EP tolerance of ``test_model_features``
(Adam turns round-off in near-zero gradients into +-lr updates: lr 1e-3 here)."""

import numpy as np
import pytest

from tests.shell.moe_loop_workers import build_moe_chat_model, moe_train_worker
from vime_shell.megatron.spawn import spawn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-loop")
    hf_dir = build_moe_chat_model(root / "qwen3-moe")
    return spawn(moe_train_worker, 2, str(root), str(hf_dir))


def test_vime_train_moe_at_ep2_with_routing_replay_equals_dp2(runs):
    dp2, ep2 = runs[0]["dp2"], runs[0]["ep2_r3"]
    assert len(dp2) == len(ep2) == 2
    for a, b in zip(dp2, ep2):
        # the same rollouts were sampled: exact, as rollout 1's logits differ only by the two
        # layouts' rounding of the trained weights (tests.metric_keys: tokens)
        assert np.array_equal(a["tokens"], b["tokens"])
        assert a["routes"] is None and b["routes"] == (len(b["tokens"]), 2 * 2)
        assert abs(a["metrics"]["loss"] - b["metrics"]["loss"]) <= 1e-6
    delta = max(float(np.max(np.abs(dp2[-1]["state"][k] - ep2[-1]["state"][k])))
                for k in dp2[-1]["state"])
    print(f"vime train MoE: EP2 + R3 vs DP2, max |param delta| {delta:.2e}")
    assert delta <= 1e-4  # 2 Adam steps at lr 1e-3 (1e-5 per 1e-4 of lr, as the layouts)
    moved = max(float(np.max(np.abs(dp2[-1]["state"][k] - dp2[0]["state"][k])))
                for k in dp2[0]["state"])
    assert moved > 1e-4  # the second rollout trained
    assert runs[1]["ep2_r3"][-1]["state"].keys() == ep2[-1]["state"].keys()
