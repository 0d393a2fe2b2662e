"""Shared multi-process Megatron run for the shell tests.

``megatron_runs`` spawns 2 gloo processes once per test session and runs every layout in them
(see ``megatron_workers``); equivalence, conversion, packing and schedule-fidelity tests all read
its results. Under pytest-xdist the first worker computes and caches the results in the
session's shared temp root behind a file lock, so the spawn happens once, not once per worker.
"""

import pickle
import time

import pytest

from tests.shell.megatron_workers import LAYOUTS


def _compute(tmp_root) -> dict:
    from vime_shell.megatron.spawn import spawn
    from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model

    hf_dir = build_tiny_hf_model(tmp_root / "tiny-qwen2-4l", TinyModelSpec(num_layers=4))
    llama_dir = build_tiny_hf_model(tmp_root / "tiny-llama-2l",
                                    TinyModelSpec(arch="llama", num_layers=2, seed=3))
    features = {"dense": str(hf_dir)}
    for name, spec in feature_specs().items():
        features[name] = str(build_tiny_hf_model(tmp_root / f"tiny-{name}", spec))
    start = time.perf_counter()
    per_rank = spawn(_worker(), 2, str(hf_dir), str(llama_dir), tuple(LAYOUTS), True, features)
    return {"per_rank": per_rank, "wall_s": time.perf_counter() - start, "hf_dir": str(hf_dir)}


def feature_specs() -> dict:
    """The tiny models of the model-feature runs (``model_workers``)."""
    from vime_shell.models.tiny_model import TinyModelSpec

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return {"dense6": TinyModelSpec(num_layers=6, seed=8),  # uneven stages with virtual ones
            "qwen3_moe": TinyModelSpec(arch="qwen3_moe", num_layers=2, seed=5),
            "qwen2_moe": TinyModelSpec(arch="qwen2_moe", num_layers=2, seed=6),
            "llama3": TinyModelSpec(arch="llama", num_layers=2, rope_theta=5e5,
                                    max_position_embeddings=512, rope_scaling=llama3, seed=7)}


def _worker():
    from tests.shell.megatron_workers import all_layouts_worker

    return all_layouts_worker


@pytest.fixture(scope="session")
def tied_chat_model(tmp_path_factory):
    """The tied, byte-level BPE, chat-template tiny Qwen2 of the tied-embedding tests: 4
    layers (PP2 x VPP2 gets 1 layer per chunk), 2 query heads sharing 1 KV head (so TP2 has
    more ranks than KV heads: Megatron all-gathers the QKV projection and each rank takes its
    query head), the vocabulary padded to a multiple of 8 rows, and the base EOS
    ``<|endoftext|>`` (only the template ends a turn at ``<|im_end|>``)."""
    from vime_shell.models.chat_model import build_chat_model

    return build_chat_model(tmp_path_factory.mktemp("tied") / "qwen", tie_word_embeddings=True,
                            num_layers=4, vocab_multiple=8, num_kv_heads=1,
                            eos_token="<|endoftext|>")


@pytest.fixture(scope="session")
def megatron_runs(tmp_path_factory) -> dict:
    from filelock import FileLock

    import os

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's root, shared by all xdist workers of this session
    cache = root / "vime-megatron-runs.pkl"
    with FileLock(str(cache) + ".lock"):
        if cache.is_file():
            return pickle.loads(cache.read_bytes())
        result = _compute(root)
        cache.write_bytes(pickle.dumps(result))
        per_layout = ", ".join(f"{name} {run['seconds']:.1f}s"
                               for name, run in result["per_rank"][0].items() if "seconds" in run)
        features = sum(run["seconds"] for rank_runs in (result["per_rank"][0].get(key, {})
                                                        for key in ("features_1", "features_2"))
                       for run in rank_runs.values() if "seconds" in run)
        print(f"\n[megatron_runs] 2-process spawn over {len(LAYOUTS)} layouts + DP1: "
              f"{result['wall_s']:.1f} s wall ({per_layout}; model features {features:.1f}s)")
        return result


@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory) -> str:
    """The embedded model's cache directory (``VIME_CACHE_DIR`` of the jobs), built once per
    test session (per xdist worker) for every job that trains the embedded default."""
    from vime_shell.models.embedded import build_embedded

    path = tmp_path_factory.mktemp("embedded")
    build_embedded(path)
    return str(path)
