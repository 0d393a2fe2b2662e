"""Loading a checkpoint never unpickles code.

Payloads that create a marker file when unpickled are planted where a ``torch_dist`` loader
looks: the torch index ``.metadata`` (read with plain ``pickle.load`` by torch), ``common.pt``
(``torch.load``) and a layer's ``_extra_state`` inside the tensor shards (read by torch's
load planner with ``torch.load(weights_only=False)``). Loading refuses the first two with
``UnsafeCheckpointError`` and loads the third without reading the object; no marker appears.
The control shows the payloads are live: Megatron's stock loader runs the extra-state one.
"""

import pickle

import pytest

from tests.shell.checkpoint_workers import Planted, planted_payloads_worker
from vime_shell.megatron.spawn import spawn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model

    root = tmp_path_factory.mktemp("planted")
    hf_dir = build_tiny_hf_model(root / "tiny", TinyModelSpec(num_layers=2))
    return spawn(planted_payloads_worker, 1, str(hf_dir), str(root))[0]


def test_the_payload_runs_when_unpickled(tmp_path):
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Planted(str(marker)))).close()
    assert marker.exists()


@pytest.mark.parametrize("name", ["metadata", "common"])
def test_a_planted_index_or_common_file_is_refused_unrun(outcomes, name):
    kind, message = outcomes[name]["error"]
    assert kind == "UnsafeCheckpointError"
    assert ("checkpoint=" in message and "Fix:" in message)
    assert not outcomes[name]["ran"]


def test_a_planted_extra_state_is_never_read(outcomes):
    assert outcomes["extra_state"] == {"error": None, "ran": False}
    assert outcomes["stock_loader_ran_it"]  # the control: the payload is live
