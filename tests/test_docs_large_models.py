"""``docs/large-models.md``'s "Memory per GPU" commands, re-derived: each full command parses as
``vime train`` flags, and the estimator on its flags and its model's shape gives the numbers
the paragraph after it states (so the page cannot drift from ``vime_pure.memory``)."""

import json
import re
import shlex
from pathlib import Path

import pytest

from tests.test_memory_estimate import QWEN25_7B, QWEN3_30B_A3B
from vime_pure.memory import GIB
from vime_shell.megatron.layout import resolve_layout
from vime_shell.run.memory_report import estimate_run
from vime_shell.settings.flags import parse_train_config

LARGE_MODELS_MD = Path(__file__).resolve().parents[1] / "docs" / "large-models.md"
SHAPES = {"Qwen2.5-7B-Instruct": QWEN25_7B, "Qwen3-30B-A3B": QWEN3_30B_A3B}
# Memory per GPU as CUDA reports it: H100 80 GB is about 80 GiB, H200 141 GB about 140 GiB.
GPUS = {"Qwen2.5-7B-Instruct": 80 * GIB, "Qwen3-30B-A3B": 140 * GIB}


def _section() -> str:
    text = LARGE_MODELS_MD.read_text()
    start = text.index("## Memory per GPU")
    return text[start:text.index("\n## ", start + 1)]


def _runs() -> list[tuple[list[str], str]]:
    """(the command's words, the paragraph after it) for each bash block of the section."""
    parts = re.split(r"```bash\n(.*?)```", _section(), flags=re.S)
    return [(shlex.split(parts[i].replace("\\\n", " ")), parts[i + 1].split("\n\n")[1])
            for i in range(1, len(parts), 2)]


@pytest.mark.parametrize("index", [0, 1], ids=["7b-dense", "30b-a3b-moe"])
def test_the_documented_command_has_the_estimators_numbers(index, tmp_path):
    words, estimate = _runs()[index]
    assert words[:4] == ["torchrun", "--nproc-per-node", words[2], "-m"]
    flags = words[words.index("train") + 1:]
    model = Path(flags[flags.index("--hf-checkpoint") + 1]).name
    (tmp_path / "config.json").write_text(json.dumps(SHAPES[model]))
    cfg = parse_train_config(flags)
    layout = resolve_layout(world_size=int(words[2]),
                            num_layers=SHAPES[model]["num_hidden_layers"],
                            supports_context_parallel=False, tp=cfg.tensor_model_parallel_size,
                            pp=cfg.pipeline_model_parallel_size,
                            ep=cfg.expert_model_parallel_size,
                            num_experts=SHAPES[model].get("num_experts"))
    on = estimate_run(cfg, tmp_path, layout, gpu_bytes=GPUS[model]).as_gib()
    flags_off = [f for f in flags if f != "--offload-train"]
    off = estimate_run(parse_train_config(flags_off), tmp_path, layout,
                       gpu_bytes=GPUS[model]).as_gib()
    stated = [float(x) for x in re.findall(r"(\d+\.\d)", estimate)]
    expected = [on["weights"], on["grads"], on["optimizer"], on["activations"],
                on["activations_no_recompute"], on["train_peak"], round(GPUS[model] / GIB, 1),
                on["generate_peak"], off["generate_peak"]]
    print(model, dict(zip(["weights", "grads", "optimizer", "activations",
                           "activations_no_recompute", "train_peak", "gpu", "generate_peak",
                           "generate_peak_resident"], expected)))
    assert stated == expected
    assert on["generate_peak"] <= GPUS[model] / GIB and on["train_peak"] <= GPUS[model] / GIB
