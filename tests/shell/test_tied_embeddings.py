"""A tied-embedding model (Qwen2.5-0.5B's shape in miniature: tied, byte-level BPE, chat
template, a base EOS) under DP2, TP2, PP2 and PP2 x VPP2, in one 2-process gloo world.

One step per layout: the shared embedding is exported once, equal to the checkpoint after
loading, and after a step the engine that loads the export scores exactly as the trainer does.
TP2 runs over a model with 1 KV head (more TP ranks than KV heads) and PP2 x VPP2 over 2 chunks
per stage; every layout's step equals DP2's to 1e-7 (the weights after one near-linear Adam
step: the same gradients).

``vime train`` per layout, through the CLI entry point: 2 rollouts with a weight sync after each
and ``--save-hf`` after the last. Exit 0 on both ranks; the engine-trainer log-prob gap < 1e-4
on both rollouts (rollout 1 is sampled by the weights synced after rollout 0); after the last
sync the engine holds exactly the trainer's weights; the export reloads in transformers with
the embedding tied to the LM head (stored once) and equals the trainer's weights bit for bit;
the weights moved.
"""

import json

import numpy as np
import pytest

from tests.shell.tied_workers import TIED_LAYOUTS, TRAIN_LAYOUTS, tied_worker
from vime_shell.megatron.spawn import spawn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tied_runs(tmp_path_factory, tied_chat_model):
    root = tmp_path_factory.mktemp("tied-train")
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(4)
            for b in range(4)]
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, spawn(tied_worker, 2, str(root), str(tied_chat_model), str(data))


@pytest.mark.parametrize("name", list(TIED_LAYOUTS))
def test_tied_model_exports_trains_and_syncs(tied_runs, name):
    for rank_out in (r["steps"] for r in tied_runs[1]):
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


@pytest.mark.parametrize("name", list(TRAIN_LAYOUTS))
def test_vime_train_syncs_and_exports_the_tied_model(tied_runs, tied_chat_model, name):
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    root, per_rank = tied_runs[0], [r["train"] for r in tied_runs[1]]
    assert [r[name]["code"] for r in per_rank] == [0, 0]
    lines = [json.loads(x) for x in (root / name / "run" / "metrics.jsonl").read_text()
             .splitlines()]
    assert [x["rollout"] for x in lines] == [0, 1]
    assert all(x["logprob_gap"] < 1e-4 and x["num_steps"] == 2 for x in lines), lines
    gaps = [r[name]["engine_vs_trainer"] for r in per_rank if "engine_vs_trainer" in r[name]]
    assert gaps and max(gaps) == 0.0
    state = per_rank[0][name]["state"]
    export = root / name / "hf_2"
    stored = {k: v for f in export.glob("*.safetensors") for k, v in load_file(f).items()}
    assert set(stored) == set(state) and "lm_head.weight" not in stored  # tied: stored once
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reloaded = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    assert all(np.array_equal(reloaded[k], state[k]) for k in state)
    initial = load_file(tied_chat_model / "model.safetensors")
    assert max(float(np.abs(state[k] - initial[k]).max()) for k in initial) > 1e-5
