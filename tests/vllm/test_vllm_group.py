"""vLLM engines in a group, on the community CPU build (``make test-vllm``).

- **in memory**: a bucketed sync through :class:`EngineGroup` writes no file (temp-file
  functions and the disk staging path are patched to fail, ``TMPDIR`` is watched) and leaves
  the engine's log-probs within the fp32 tolerance (1e-4) of the new weights; measured ~1e-7;
- **prefix cache**: a 48-token prompt cached before a sync is scored with the new weights after
  it (without the reset the gap is ~1e-2: the test checks it is sensitive);
- **external launcher**: 2 ranks, 2 engines (vLLM's ``external_launcher`` inside a gloo world,
  as under torchrun) gather the same batch as one in-process engine with the same seeds, then
  sync from memory; and 1 engine of 2 ranks (vLLM tensor parallel) does the same.

Start, generation and sync times are printed (``-s``) for the report.
"""

import os
import tempfile

import numpy as np
import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import vime_shell.engines.vllm as vllm_adapter  # noqa: E402
from tests.vllm.group_workers import vllm_group_worker  # noqa: E402
from vime_shell.engines import SamplingParams, select_engine  # noqa: E402
from vime_shell.engines.group import EngineGroup, EngineOptions  # noqa: E402
from vime_shell.engines.hf import HfEngine  # noqa: E402
from vime_shell.engines.layout import logprob_gap_tolerance, resolve_engine_layout  # noqa: E402
from vime_shell.engines.weights import load_safetensors_dir  # noqa: E402
from vime_shell.megatron.spawn import spawn  # noqa: E402
from vime_shell.models.tokenizer import load_tokenizer  # noqa: E402

FP32_TOL = logprob_gap_tolerance("float32")


@pytest.fixture(scope="module")
def dirs(embedded_pair):
    return embedded_pair


@pytest.fixture(scope="module")
def group(dirs):
    # block_size 32 (the CPU attention minimum): a 48-token prompt fills one block, which the
    # prefix cache then holds.
    engine = select_engine("vllm", dirs[0], seed=0, max_model_len=64, enforce_eager=True,
                           block_size=32)
    g = EngineGroup(resolve_engine_layout(world_size=1, engine="vllm"), 0, engine,
                    EngineOptions(engine="vllm", update_weight_buffer_size=16384))
    yield g
    g.close()


def _rescore(model, prompts, gens):
    """Log-probs of the generated tokens under ``model`` (one forward per request)."""
    out = []
    with torch.no_grad():
        for p, g in zip(prompts, gens):
            seq = torch.tensor([list(p) + list(g.token_ids)])
            logits = model(input_ids=seq).logits[0, len(p) - 1:-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, seq[0, len(p):, None])[:, 0])
    return out


def _gaps(gens, rescored):
    diff = torch.cat([torch.tensor(g.log_probs) - r for g, r in zip(gens, rescored)]).abs()
    return float(diff.mean()), float(diff.max())


class _NoFiles:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a weight sync must not create files")


def test_bucketed_sync_writes_no_file_and_follows_the_new_weights(group, dirs, monkeypatch,
                                                                  tmp_path):
    tokenizer = load_tokenizer(dirs[0])
    prompts = [tokenizer(p)["input_ids"] for p in ["12>", "34>", "56>", "3+4=", "aab#"] * 4]
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=5)
    new = load_safetensors_dir(dirs[1])
    watched = tmp_path / "tmp"
    watched.mkdir()
    monkeypatch.setenv("TMPDIR", str(watched))
    monkeypatch.setattr(tempfile, "tempdir", str(watched))
    for name in ("mkstemp", "mkdtemp", "NamedTemporaryFile", "TemporaryDirectory",
                 "SpooledTemporaryFile", "TemporaryFile"):
        monkeypatch.setattr(tempfile, name, _NoFiles)
    monkeypatch.setattr(vllm_adapter, "save_safetensors_dir", _NoFiles)
    before_dirs = {d: sorted(os.listdir(d)) for d in dirs}
    try:  # only the sync is watched: a first generation may compile kernels into a cache
        report = group.sync_weights(iter(new.items()))
    finally:
        monkeypatch.undo()
    assert list(watched.iterdir()) == [] and {d: sorted(os.listdir(d)) for d in dirs} == before_dirs
    gens = group.engine.generate(prompts, params)
    mean, worst = _gaps(gens, _rescore(HfEngine(dirs[1]).model, prompts, gens))
    print(f"\n[vllm in-memory sync] {report.tensors} tensors, {report.bytes} bytes in "
          f"{report.buckets} buckets, {report.seconds * 1e3:.1f} ms; gap mean {mean:.1e} "
          f"max {worst:.1e}")
    assert report.buckets > 1 and mean < FP32_TOL and worst < 10 * FP32_TOL
    group.sync_weights(iter(load_safetensors_dir(dirs[0]).items()))  # back for the next test


def test_prefix_cache_is_reset_by_every_sync(group, dirs, monkeypatch):
    tokenizer = load_tokenizer(dirs[0])
    prompt = [tokenizer("1234567890ab>=+#" * 3)["input_ids"][:48]]
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    reference = HfEngine(dirs[1]).model

    def gap_after_sync(weights):
        group.engine.generate(prompt, greedy)  # caches the prompt's blocks
        group.sync_weights(iter(load_safetensors_dir(weights).items()))
        gens = group.engine.generate(prompt, greedy)
        return _gaps(gens, _rescore(reference, prompt, gens))[1]

    assert gap_after_sync(dirs[1]) < FP32_TOL
    group.sync_weights(iter(load_safetensors_dir(dirs[0]).items()))
    monkeypatch.setattr(group.engine._llm, "reset_prefix_cache", lambda *a, **k: True)
    stale = gap_after_sync(dirs[1])  # the control: without the reset, old KV blocks are reused
    monkeypatch.undo()
    group.engine._llm.reset_prefix_cache()
    print(f"\n[vllm prefix cache] gap without reset {stale:.1e}")
    assert stale > 100 * FP32_TOL
    group.sync_weights(iter(load_safetensors_dir(dirs[0]).items()))


@pytest.fixture(scope="module")
def reference_run(dirs):
    (out,) = spawn(vllm_group_worker, 1, str(dirs[0]), str(dirs[1]), 1, 1, fresh=True)
    return out


@pytest.mark.parametrize("per_engine", [1, 2], ids=["2x1gpu", "1x2gpu-tp2"])
def test_external_launcher_engines_gather_the_single_engine_batch(reference_run, dirs,
                                                                  per_engine):
    ranks = spawn(vllm_group_worker, 2, str(dirs[0]), str(dirs[1]), 2, per_engine, fresh=True)
    got, ref = ranks[0]["merged"], reference_run["merged"]
    assert ranks[1]["merged"] is None
    tol = 1e-5 if per_engine == 1 else 1e-4  # TP splits the matmuls: float order changes
    for key in ("tokens", "lengths", "group_ids", "prompt_groups", "rewards", "advantages"):
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(ref[key]), err_msg=key)
    np.testing.assert_allclose(got["rollout_log_probs"], ref["rollout_log_probs"], atol=tol)
    reference = HfEngine(dirs[1]).model
    for r in ranks:  # every rank's engine (or TP shard) follows the new weights
        gens = [type("G", (), {"token_ids": t, "log_probs": lp}) for t, lp in r["after"]]
        mean, worst = _gaps(gens, _rescore(reference, r["greedy_ids"], gens))
        assert mean < FP32_TOL, (r["engine"], mean, worst)
    print(f"\n[vllm external launcher {per_engine} GPU/engine] start "
          f"{[round(r['start_s'], 1) for r in ranks]} s, generate "
          f"{[round(r['generate_s'], 2) for r in ranks]} s, sync "
          f"{[round(r['sync_s'] * 1e3, 1) for r in ranks]} ms, gap after sync {mean:.1e}; "
          f"single engine: start {reference_run['start_s']:.1f} s; default group survives "
          f"engine close: {[r['group_survives_close'] for r in ranks]}")
