"""Launch: layouts resolved from Megatron-style sizes; unsupported ones fail at launch, typed.

Also the CPU torch.cuda compatibility layer, checked in a fresh interpreter (it is process-wide).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vime_shell.megatron.layout import UnsupportedLayoutError, resolve_layout

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_pp2_vpp2_layout_resolves_with_microbatch_group():
    layout = resolve_layout(world_size=4, num_layers=4, supports_context_parallel=False, pp=2,
                            num_layers_per_virtual_stage=1)
    assert (layout.dp, layout.pp, layout.vpp, layout.microbatch_group) == (2, 2, 2, 2)
    assert layout.scheduler_layout().align_multiple == 4


@pytest.mark.parametrize("kwargs, match", [
    ({"world_size": 2, "cp": 2}, "context_parallel_size=2"),
    ({"world_size": 3, "tp": 2}, "not divisible"),
    ({"world_size": 3, "pp": 3}, "pipeline_model_parallel_size=3"),
    ({"world_size": 2, "pp": 2, "num_layers_per_virtual_stage": 3}, "virtual"),
    ({"world_size": 2, "num_layers_per_virtual_stage": 1},
     "needs --pipeline-model-parallel-size >= 2"),
    ({"world_size": 2, "tp": 0}, "positive"),
])
def test_unsupported_layouts_are_typed_errors(kwargs, match):
    with pytest.raises(UnsupportedLayoutError, match=match):
        resolve_layout(num_layers=4, supports_context_parallel=False, **kwargs)


def _env():
    return dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1", WORLD_SIZE="2")


@pytest.mark.slow
def test_cp_on_cpu_fails_at_launch_with_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "num_hidden_layers": 4, "vocab_size": 32}')
    proc = subprocess.run(
        [sys.executable, "-m", "vime_shell.megatron.launch", "--hf-checkpoint", str(tmp_path),
         "--context-parallel-size", "2"], capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line, no traceback
    assert proc.stderr.startswith("UnsupportedLayoutError: context_parallel_size=2")


@pytest.mark.slow
def test_cuda_compat_layer_facts_in_the_spawned_workers(megatron_runs):
    for rank in (0, 1):
        facts = megatron_runs["per_rank"][rank]["compat"]
        assert facts == {
            "reinstall": True, "distinct": True, "is_available": False, "zeros_device": "cpu",
            "cuda_is_identity": True, "type_name": "torch.cuda.FloatTensor",
            "int_device": "cpu", "to_int": "cpu", "manual_seed_repeats": True}
