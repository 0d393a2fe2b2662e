"""The objectives beside GRPO's PPO surrogate train end to end on the embedded model: GSPO
and CISPO (``--advantage-estimator``), two optimizer steps per rollout so the second step's
ratios move off 1 and the surrogates differ. Each run trains 2 rollouts through the Megatron
trainer, syncs the engine (the log-prob gap checked every rollout), and exports with
``--save-hf``: the export reloads in transformers with the Megatron model's log-probs
(``test_save_hf.check_export``)."""

import math

import numpy as np
import pytest

from tests.shell.loop_workers import save_hf_worker
from tests.shell.test_save_hf import check_export
from vime_shell.megatron.spawn import spawn

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("estimator, options", [
    ("gspo", {}),
    ("cispo", {"eps_clip": 1.0, "eps_clip_high": 4.0}),  # the paper's one-sided band
])
def test_the_objective_trains_syncs_and_exports(tmp_path_factory, estimator, options):
    root = tmp_path_factory.mktemp(estimator)
    probe = np.random.default_rng(1).integers(3, 19, size=(2, 5))
    out = spawn(save_hf_worker, 1, str(root), str(root / "embedded"), probe,
                {"advantage_estimator": estimator, "num_steps_per_rollout": 2, **options})[0]
    assert len(out["metrics"]) == 2
    for record in out["metrics"]:
        assert math.isfinite(record["loss"]) and math.isfinite(record["pg_loss"])
        assert record["logprob_gap"] is None or record["logprob_gap"] < 1e-4
    check_export(root / "hf", out, probe)
