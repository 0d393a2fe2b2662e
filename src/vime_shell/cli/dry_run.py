"""``vime train --dry-run``: every launch check, then what the run would be, without building a
model or an engine (no torch CUDA, no Megatron model code).

The report, after ``launch_checks`` passed (datasets, plugins, the HF config cross-check,
``check_feasible``, paths): the resolved configuration by section (``*`` marks a value that
differs from the default), the parallel layout, the engine layout, and the schedule of one
synthetic rollout of the configured shape (``--rollout-batch-size`` x
``--n-samples-per-prompt`` one-sample groups of ``SYNTHETIC_PROMPT_LEN`` prompt tokens (6 for a
built-in task) and
responses spread over ``[1, --rollout-max-response-len]``, seeded) as ``vime schedule`` prints
it, and the memory estimate of ``vime_shell.run.memory_report``.

Example: ``vime train --dry-run --num-rollout 5`` prints ``parallel layout: world 1 = tp 1 x pp
1 x cp 1 x dp 1`` and a one-step table, and exits 0.
"""

import attrs
import numpy as np

from vime_pure.memory import GIB
from vime_pure.scheduling.planner import build_schedule
from vime_pure.scheduling.report import step_stats
from vime_shell.cli.schedule import format_table
from vime_shell.run.memory_report import estimate_run
from vime_shell.settings.launch_plan import LaunchPlan
from vime_shell.settings.train_config import SECTIONS, TrainConfig

MEMORY_GPU_GIB = 80  # the GPU the memory estimate assumes (the printed line says so)
SYNTHETIC_PROMPT_LEN = 128  # tokens; a dataset's own lengths need its tokenizer (seconds)


def configuration_lines(cfg: TrainConfig) -> list[str]:
    """``[section]`` headers and one ``--flag value`` line per setting."""
    defaults = {f.name: f.default for f in attrs.fields(type(cfg))}
    lines = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for name, value in cfg.section(section).items():
            mark = "*" if value != defaults[name] else " "
            shown = " ".join(map(str, value)) if isinstance(value, tuple) else value
            lines.append(f"  {mark} --{name.replace('_', '-')} {shown}")
    return lines


def synthetic_lengths(cfg: TrainConfig, max_response_len: int) -> np.ndarray:
    """One rollout's sample lengths (module docstring), seeded by ``--seed``."""
    rng = np.random.default_rng(cfg.seed)
    return prompt_len(cfg) + rng.integers(1, max_response_len + 1, cfg.groups_per_rollout)


def prompt_len(cfg: TrainConfig) -> int:
    """``SYNTHETIC_PROMPT_LEN`` for a dataset; a built-in task's prompts are ~6 tokens."""
    return SYNTHETIC_PROMPT_LEN if cfg.prompt_data is not None else 6


def layout_lines(plan: LaunchPlan) -> list[str]:
    lay = plan.layout
    out = [f"parallel layout: world {lay.world_size} = tp {lay.tp} x pp {lay.pp} x cp "
           f"{lay.cp} x dp {lay.dp}" + (f", {lay.vpp} virtual stages" if lay.vpp > 1 else "")]
    eng = plan.engine_layout
    out.append("engine layout: none (train-only replay)" if eng is None else
               f"engine layout: {eng.num_engines} {eng.engine} engine(s) x "
               f"{eng.gpus_per_engine} rank(s) "
               f"on ranks 0..{eng.rollout_num_gpus - 1} of {eng.world_size}")
    return out


def dry_run_report(cfg: TrainConfig, plan: LaunchPlan) -> str:
    """The whole report (module docstring)."""
    lengths = synthetic_lengths(cfg, cfg.max_response_len)
    groups = np.arange(len(lengths))
    schedule = build_schedule(lengths, groups, plan.layout.scheduler_layout(), plan.policy)
    stats = step_stats(schedule)
    lines = ["vime train --dry-run: every launch check passed", "", "configuration "
             "(* = not the default):", *configuration_lines(cfg), "", *layout_lines(plan),
             f"model: {plan.hf_dir}; rollouts: {plan.num_rollout}; prompts: "
             + (f"{len(plan.prompts)} dataset rows" if plan.prompts is not None
                else f"built-in task {cfg.task}")
             + "".join(f"; eval {name}: {len(rows)} rows" for name, rows in plan.eval_sets),
             "", f"schedule of one synthetic rollout: {len(lengths)} samples of "
             f"{prompt_len(cfg)} + 1..{cfg.max_response_len} tokens",
             format_table(stats),
             f"trained: {sum(s.num_groups for s in stats)} groups in {len(stats)} steps; "
             f"dropped: {len(schedule.dropped_groups)} groups", "", memory_line(cfg, plan)]
    return "\n".join(lines)


def memory_line(cfg: TrainConfig, plan: LaunchPlan) -> str:
    """``vime_shell.run.memory_report``'s per-GPU estimate (bf16, an 80 GiB GPU assumed)."""
    gib = estimate_run(cfg, plan.hf_dir, plan.layout, gpu_bytes=MEMORY_GPU_GIB * GIB).as_gib()
    return (f"memory estimate per GPU (bf16, {MEMORY_GPU_GIB} GiB GPU): weights "
            f"{gib['weights']}, grads {gib['grads']}, optimizer {gib['optimizer']}, "
            f"activations {gib['activations']}, train peak {gib['train_peak']}, generate "
            f"peak {gib['generate_peak']} GiB")
