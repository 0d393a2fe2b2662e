"""A tied-embedding model (Qwen2.5-0.5B's shape in miniature: tied, byte-level BPE, chat
template) exports, trains and syncs under DP2, TP2, PP2 and PP2 x VPP2: the shared embedding
is exported once, equal to the checkpoint after loading, and after a step the engine that
loads the export scores exactly as the trainer does."""

import pytest

from tests.shell.tied_workers import TIED_LAYOUTS, tied_layouts_worker
from vime_shell.megatron.spawn import spawn
from vime_shell.models.chat_model import build_chat_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tied_runs(tmp_path_factory):
    model = build_chat_model(tmp_path_factory.mktemp("tied") / "qwen", tie_word_embeddings=True,
                             num_layers=2, vocab_multiple=8, num_kv_heads=2)
    return spawn(tied_layouts_worker, 2, str(model))


@pytest.mark.parametrize("name", list(TIED_LAYOUTS))
def test_tied_model_exports_trains_and_syncs(tied_runs, name):
    for rank_out in tied_runs:
        run = rank_out[name]
        assert run["names_unique"] and run["keys_equal"], run
        assert run["roundtrip_max"] == 0.0
        assert run["moved"] > 1e-6
        if run["engine_vs_trainer"] is not None:
            assert run["engine_vs_trainer"] < 1e-5, run
