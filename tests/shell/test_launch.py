"""Launch: layouts resolved from Megatron-style sizes; unsupported ones fail at launch, typed.

Also the CPU torch.cuda compatibility layer, checked in a fresh interpreter (it is process-wide).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vime_shell.platform import Platform, UnsupportedLayoutError, resolve_layout

CPU = Platform(kind="cpu", backend="gloo", dtype=torch.float32, transformer_engine=False,
               packing="mask")
SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_pp2_vpp2_layout_resolves_with_microbatch_group():
    layout = resolve_layout(world_size=4, num_layers=4, platform=CPU, pp=2,
                            num_layers_per_virtual_stage=1)
    assert (layout.dp, layout.pp, layout.vpp, layout.microbatch_group) == (2, 2, 2, 2)
    assert layout.scheduler_layout().align_multiple == 4


@pytest.mark.parametrize("kwargs, match", [
    ({"world_size": 2, "cp": 2}, "context_parallel_size=2"),
    ({"world_size": 3, "tp": 2}, "not divisible"),
    ({"world_size": 3, "pp": 3}, "pipeline_model_parallel_size=3"),
    ({"world_size": 2, "pp": 2, "num_layers_per_virtual_stage": 3}, "virtual"),
    ({"world_size": 2, "num_layers_per_virtual_stage": 1}, "needs pp >= 2"),
    ({"world_size": 2, "tp": 0}, "positive"),
])
def test_unsupported_layouts_are_typed_errors(kwargs, match):
    with pytest.raises(UnsupportedLayoutError, match=match):
        resolve_layout(num_layers=4, platform=CPU, **kwargs)


def _env():
    return dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1", WORLD_SIZE="2")


@pytest.mark.slow
def test_cp_on_cpu_fails_at_launch_with_one_line(tmp_path):
    from vime_shell.tiny_model import hf_config, TinyModelSpec

    hf_config(TinyModelSpec()).save_pretrained(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "vime_shell.launch", "--hf-checkpoint", str(tmp_path),
         "--context-parallel-size", "2"], capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 2
    assert "UnsupportedLayoutError: context_parallel_size=2" in proc.stderr
    assert "Traceback" not in proc.stderr


COMPAT_CHECK = """
import torch
from vime_shell import cuda_compat
assert cuda_compat.install() and cuda_compat.install()  # idempotent
ids = [id(getattr(torch.cuda, n)) for n in cuda_compat.PATCHED_ATTRIBUTES]
assert len(set(ids)) == len(ids), "patched torch.cuda attributes must be distinct objects"
assert not torch.cuda.is_available()
t = torch.zeros(2, device="cuda")
assert t.device.type == "cpu" and t.cuda() is t
assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"
assert t.type() == "torch.cuda.FloatTensor" and t.to(0).device.type == "cpu"
torch.cuda.manual_seed(3); a = torch.rand(2); torch.cuda.manual_seed(3)
assert torch.equal(a, torch.rand(2))
state = torch.cuda.get_rng_state(); b = torch.rand(1); torch.cuda.set_rng_state(state)
assert torch.equal(b, torch.rand(1))
with torch.cuda.stream(torch.cuda.Stream()):
    torch.cuda.current_stream().synchronize()
print("ok")
"""


@pytest.mark.slow
def test_cuda_compat_layer_in_a_fresh_process():
    proc = subprocess.run([sys.executable, "-c", COMPAT_CHECK], capture_output=True, text=True,
                          env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
