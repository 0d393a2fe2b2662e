"""``--save-hf``: the trained Megatron weights as a Hugging Face checkpoint.

Trains 2 rollouts with ``--save-hf`` and a small shard limit, then asserts: the directory holds
several ``model-0000k-of-0000N.safetensors`` shards and an index covering every weight; it
reloads in transformers, whose next-token log-probs on a probe equal the Megatron model's
(the export is the trained model, not the initial one); the weights are exactly the trainer's.
Through the CLI, a ``--save-hf`` equal to the source directory is refused before training.
"""

import json

import numpy as np
import pytest

from tests.shell.loop_workers import save_hf_worker
from vime_shell.cli import main as cli
from vime_shell.megatron.spawn import spawn


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    # The first worker builds the embedded model here; later ones reuse it.
    return tmp_path_factory.mktemp("embedded")


@pytest.mark.slow
def test_exported_checkpoint_reloads_with_the_megatron_logits(tmp_path, cache):
    probe = np.random.default_rng(0).integers(3, 19, size=(3, 6))
    out = spawn(save_hf_worker, 1, str(tmp_path), str(cache), probe)[0]
    check_export(tmp_path / "hf", out, probe)


def check_export(hf, out: dict, probe: np.ndarray) -> None:
    """The export in ``hf`` holds the trainer's weights, moved by training, in shards its
    index covers, and reloads in transformers with the Megatron model's log-probs."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in hf.glob("model-*.safetensors"))
    assert len(shards) >= 2 and set(index["weight_map"].values()) == set(shards)
    assert set(index["weight_map"]) == set(out["state"])
    for name in ("config.json", "tokenizer.json"):
        assert (hf / name).is_file()
    exported = {k: v for s in shards for k, v in load_file(hf / s).items()}
    assert all(np.array_equal(exported[k], out["state"][k]) for k in out["state"])
    initial = load_file(f"{out['hf_dir']}/model.safetensors")
    assert any(not np.array_equal(exported[k], initial[k]) for k in initial)  # trained

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = torch.as_tensor(probe)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    np.testing.assert_allclose(logp.numpy(), out["log_probs"], atol=1e-5, rtol=0)


def test_cli_refuses_to_export_over_the_source(tmp_path, capsys):
    source = tmp_path / "model"  # launch checks need only an HF-looking directory
    source.mkdir()
    (source / "config.json").write_text("{}")
    code = cli.main(["train", "--hf-checkpoint", str(source), "--save-hf", str(source),
                     "--num-rollout", "1", "--run-dir", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err
    assert "--save-hf=" in err and "is the source model (--hf-checkpoint)" in err
    assert not (tmp_path / "run").exists()  # refused before anything ran
    code = cli.main(["train", "--hf-checkpoint", str(source), "--save-hf", str(tmp_path / "o"),
                     "--save-hf-max-shard-size", "lots", "--run-dir", str(tmp_path / "run")])
    assert code == 2 and "--save-hf-max-shard-size" in capsys.readouterr().err
