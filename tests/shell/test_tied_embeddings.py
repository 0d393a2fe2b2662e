"""A tied-embedding model (Qwen2.5-0.5B's shape in miniature: tied, byte-level BPE, chat
template) exports, trains and syncs under DP2, TP2, PP2 and PP2 x VPP2: the shared embedding
is exported once, equal to the checkpoint after loading, and after a step the engine that
loads the export scores exactly as the trainer does. TP2 runs over a model with 1 KV head (more
TP ranks than KV heads) and PP2 x VPP2 over 2 chunks per stage; every layout's step equals
DP2's to 1e-7 (the weights after one near-linear Adam step: the same gradients)."""

import numpy as np
import pytest

from tests.shell.tied_workers import TIED_LAYOUTS, tied_layouts_worker
from vime_shell.megatron.spawn import spawn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tied_runs(tied_chat_model):
    return spawn(tied_layouts_worker, 2, str(tied_chat_model))


@pytest.mark.parametrize("name", list(TIED_LAYOUTS))
def test_tied_model_exports_trains_and_syncs(tied_runs, name):
    for rank_out in tied_runs:
        run = rank_out[name]
        assert run["vpp"] == (2 if name == "pp2_vpp2" else 1)  # 4 layers: 1 per chunk
        assert run["names_unique"] and run["keys_equal"], run
        assert run["roundtrip_max"] == 0.0
        assert run["moved"] > 1e-5
        # the same step as DP2: TP2 over 1 KV head and the pipelines have its gradients
        dp2 = rank_out["dp2"]["trained"]
        assert max(float(np.abs(run["trained"][k] - dp2[k]).max()) for k in dp2) < 1e-7
        if run["engine_vs_trainer"] is not None:
            assert run["engine_vs_trainer"] < 1e-5, run
