"""slime's flags on ``vime train``, per flag group: each value reaches the object it configures,
a bad value exits 2 with one line before torch is imported, and a flag vime does not support
prints its table line (never a misleading did-you-mean)."""

import argparse
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import attrs

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vime_pure import ParallelLayout, build_schedule
from vime_shell.cli.dry_run import configuration_lines
from vime_shell.cli.main import build_parser, main
from vime_shell.engines.layout import DEFAULT_GPU_MEMORY_UTILIZATION
from vime_shell.models.embedded import build_embedded, default_cache_dir
from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model
from vime_shell.rollout.functions import DEFAULT_ROLLOUT_FUNCTION
from vime_shell.run.checkpoint_index import resume_checkpoint
from vime_shell.run.components import engine_options, trainer_config
from vime_shell.run.launch_checks import launch_checks, model_dir
from vime_shell.run.report import launch_warnings
from vime_shell.run.run_log import wandb_names
from vime_shell.settings.flags import config_from_args, parse_train_config
from vime_shell.settings.megatron_args import ModelArchArgs
from vime_shell.settings.slime_flags import (FP8, UNSUPPORTED, default_flags, engine_flags,
                                             redact)
from vime_shell.settings.train_config import ConfigError, TrainConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model():
    return build_embedded()


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return build_tiny_hf_model(tmp_path_factory.mktemp("moe") / "m",
                               TinyModelSpec(arch="qwen3_moe"))


def _exit(argv, capsys) -> tuple[int, str]:
    try:
        status = main(["train", *argv])
    except SystemExit as exc:  # argparse's own errors exit from the parser
        status = exc.code
    return status, capsys.readouterr().err.strip()


def test_eps_clip_0_fails_at_launch_in_one_line_without_torch():
    """The issue's measurement: the knob's one check runs before any heavy import."""
    code = ("import sys; from vime_shell.cli.main import main; rc = main(['train', "
            "'--eps-clip', '0']); print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO / "src"), "PATH": ""}, timeout=60)
    assert out.stdout.split() == ["2", "False"], out.stderr
    assert out.stderr.strip() == ("vime train: error: --eps-clip=0.0: must lie in (0, 1]. "
                                  "Fix: use e.g. 0.2 (1: no lower clip).")


@pytest.mark.parametrize("argv, flag", [
    (["--eps-clip", "1.5"], "--eps-clip="), (["--eps-clip-c", "0.5"], "--eps-clip-c="),
    (["--tis-clip", "0"], "--tis-clip="), (["--lr", "0"], "--lr="),
    (["--hidden-dropout", "0.1"], "--hidden-dropout="),
    (["--kl-coef", "-1"], "--kl-coef="),
    (["--optimizer", "sgd"], "--optimizer"), (["--actor-num-gpus-per-node", "8"],
                                              "--actor-num-gpus-per-node="),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "none"], "--use-dynamic-batch-size"),
])
def test_bad_slime_values_exit_2_with_one_line(argv, flag, capsys):
    status, err = _exit(argv, capsys)
    assert status == 2 and len(err.splitlines()) == 1 and flag in err, err


def test_loss_and_optimizer_flags_reach_their_records():
    cfg = parse_train_config(["--eps-clip-c", "3", "--eps-clip-high", "0.28", "--lr", "1e-5",
                              "--optimizer", "adam", "--attention-dropout", "0.0"])
    loss, optim = trainer_config(cfg).loss, trainer_config(cfg).optim
    assert (loss.dual_clip, loss.eps_clip_high, optim.lr) == (3.0, 0.28, 1e-5)


def test_lr_warmup_fraction_is_a_share_of_the_run():
    cfg = parse_train_config(["--lr-warmup-fraction", "0.1", "--num-rollout", "50",
                              "--num-steps-per-rollout", "2"])
    assert trainer_config(cfg).optim.lr_warmup_groups == 10 * 64  # 10 of 100 steps x 64 groups


def test_aliases_and_engine_flags_reach_the_engine_options():
    cfg = parse_train_config(["--sglang-mem-fraction-static", "0.5", "--vllm-enforce-eager",
                              "--load-forge-rollout-data", "d/r_{rollout_id}.npz",
                              "--vllm-max-num-seqs", "64", "--sglang-kv-cache-dtype", "fp8"])
    assert (cfg.load_rollout_data, cfg.load_rollout_data_mode) == ("d/r_{rollout_id}.npz",
                                                                   "forge")
    options = engine_options(cfg, cuda=False)
    assert (options.gpu_memory_utilization, options.enforce_eager) == (0.5, True)
    assert dict(options.vllm_args) == {"max_num_seqs": 64, "kv_cache_dtype": "fp8"}
    assert TrainConfig().rollout_gpu_memory_utilization == DEFAULT_GPU_MEMORY_UTILIZATION
    engine, warnings, rest = engine_flags(["--sglang-ep-size", "8", "--lr", "1"])
    assert engine == [] and rest == ["--lr", "1"]
    assert warnings[0].startswith("--sglang-ep-size 8: no vLLM equivalent")


def test_config_file_takes_slime_spellings(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"load_debug_rollout_data": "x.npz", "num_layers": 2}))
    parser_args = type("A", (), {})()
    parser_args.__dict__.update(config=str(path))
    cfg = config_from_args(parser_args)
    assert (cfg.load_rollout_data, cfg.num_layers) == ("x.npz", 2)


def test_static_micro_batches_without_dynamic_batch_size():
    """slime: --micro-batch-size without --use-dynamic-batch-size is static batching."""
    assert parse_train_config(["--micro-batch-size", "2"]).batching_policy().micro_batch_size == 2
    packed = parse_train_config(["--use-dynamic-batch-size", "--max-tokens-per-gpu", "512"])
    assert packed.batching_policy().max_tokens_per_gpu == 512


@pytest.mark.parametrize("flag", ["--multimodal-keys", "--fp8-format",
                                  "--filter-zero-reward-samples"])
def test_unsupported_flag_prints_its_table_line(flag, capsys, tmp_path):
    # a dry run in a scratch run directory: a flag that stops being refused never trains here
    status, err = _exit([flag, "1", "--dry-run", "--run-dir", str(tmp_path)], capsys)
    assert status == 2
    assert err == f"vime train: error: {flag}: not supported in vime ({UNSUPPORTED[flag]})"


def test_miles_dynamic_global_batch_size_is_one_step_per_rollout():
    """miles' --use-dynamic-global-batch-size: each rollout's kept samples are one optimizer
    step (its gbs is ignored). vime: --num-steps-per-rollout 1 with partial steps, so a rollout
    dynamic sampling cut to 100 of its 256 groups is one step of 100, and a full one of 256."""
    cfg = parse_train_config(["--use-dynamic-global-batch-size", "--rollout-batch-size", "32",
                              "--n-samples-per-prompt", "8", "--global-batch-size", "64"])
    policy = cfg.batching_policy()
    assert (policy.global_batch_size, policy.allow_partial_step) == (256, True)
    for groups in (100, 256):
        schedule = build_schedule([12] * groups, list(range(groups)), ParallelLayout(dp=2),
                                  policy)
        assert schedule.num_steps == 1 and list(schedule.step_groups) == [groups]
    lr = cfg.lr_schedule(10)  # one step of 256 groups per rollout
    assert (lr.steps_per_rollout, lr.decay_steps, lr.decay_groups) == (1, 10, 2560)
    notes = launch_warnings(cfg, 10)
    assert any(n.startswith("--use-dynamic-global-batch-size: one optimizer step per rollout")
               and n.endswith("--global-batch-size 64 is unused, as in miles") for n in notes)
    with pytest.raises(ConfigError, match="--num-steps-per-rollout=2: contradicts "
                                          "--use-dynamic-global-batch-size"):
        parse_train_config(["--use-dynamic-global-batch-size", "--num-steps-per-rollout", "2"])
    assert not parse_train_config([]).partial_steps  # off by default: whole steps of 128


@pytest.mark.parametrize("flag", ["--rm-urll", "--use-dynamic-batchsize2", "--partial-rollouts"])
def test_no_misleading_did_you_mean(flag, capsys):
    """The issue's cases: a near-miss of a real flag is suggested, an unrelated one never."""
    status, err = _exit([flag], capsys)
    assert status == 2 and "--min-lr" not in err and "--micro-batch-size" not in err
    assert "--num-rollout" not in err


def test_architecture_cross_check(model, capsys):
    args = ["--hf-checkpoint", str(model), "--num-layers", "2", "--hidden-size", "128",
            "--swiglu", "--num-query-groups", "2", "--rotary-base", "10000", "--vocab-size",
            "20", "--normalization", "RMSNorm", "--add-qkv-bias", "--disable-bias-linear"]
    cfg = parse_train_config(args)
    assert launch_checks(cfg, model_dir(cfg)).layout.dp == 1  # a match passes
    status, err = _exit([*args[:2], "--hidden-size", "4096"], capsys)
    assert status == 2 and "--hidden-size=4096" in err and '"hidden_size": 128' in err, err


def test_ref_load_alone_is_the_initial_weights(model, tmp_path):
    cfg = TrainConfig(ref_load=str(model), hf_checkpoint=str(tmp_path))
    assert model_dir(cfg) == model  # slime: training starts from --ref-load
    with pytest.raises(ConfigError, match="Megatron checkpoint"):
        (tmp_path / "mcore").mkdir()
        (tmp_path / "mcore" / "latest_checkpointed_iteration.txt").write_text("10")
        c = TrainConfig(ref_load=str(tmp_path / "mcore"))
        launch_checks(c, model)


def test_load_equal_to_save_starts_fresh_only_when_empty(tmp_path):
    ck = tmp_path / "ck"
    assert resume_checkpoint(str(ck), str(ck)) is None  # missing: slime's first run
    ck.mkdir()
    assert resume_checkpoint(str(ck), str(ck)) is None  # empty
    with pytest.raises(Exception, match="--load"):  # another path: a typo never starts afresh
        resume_checkpoint(str(tmp_path / "typo"), str(ck))
    (ck / "stray.txt").write_text("x")
    with pytest.raises(Exception, match="holds no checkpoint"):
        resume_checkpoint(str(ck), str(ck))


def test_load_naming_the_hf_checkpoint_starts_from_its_weights(tmp_path):
    """miles' FSDP scripts: ``--load`` = ``--hf-checkpoint`` (HF weights, no tracker) starts
    from those weights; once the directory holds a tracker it is a checkpoint like any."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resume_checkpoint(str(hf), str(tmp_path / "save"), weights=str(hf)) is None
    with pytest.raises(Exception, match="holds no checkpoint"):  # without weights: a typo
        resume_checkpoint(str(hf), str(tmp_path / "save"))
    (hf / "latest_checkpointed_iteration.txt").write_text("3\n")
    with pytest.raises(Exception, match="--load"):  # a tracker: must be a whole checkpoint
        resume_checkpoint(str(hf), str(tmp_path / "save"), weights=str(hf))


def test_the_dry_run_report_shows_a_list_of_ids():
    """slime's GLM scripts pass --rollout-stop-token-ids: the report printed it by joining
    ints as strings, and the dry run crashed."""
    lines = configuration_lines(parse_train_config(["--rollout-stop-token-ids", "1", "7"]))
    assert any(line.endswith("--rollout-stop-token-ids 1 7") for line in lines)


def test_eval_prompt_data_without_interval_is_valid():
    cfg = TrainConfig(eval_prompt_data=("a", "a.jsonl"), prompt_data="t.jsonl",
                      rollout_max_response_len=4)
    assert cfg.eval_interval is None
    with pytest.raises(ConfigError, match="needs --eval-prompt-data"):
        TrainConfig(eval_interval=5)


def test_dry_run_imports_neither_cuda_nor_megatron_models(model):
    code = ("import sys; from vime_shell.cli.main import main; rc = main(['train', "
            "'--dry-run', '--num-rollout', '2']); mods = [m for m in sys.modules if "
            "m.startswith(('torch', 'megatron.core.models', 'transformers'))]; "
            "print(rc, len(mods), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO / "src"), "PATH": ""}, timeout=60)
    assert out.stderr.strip().splitlines()[-1] == "0 0", out.stderr[-1000:]
    assert "[optimizer]" in out.stdout and "parallel layout: world 1" in out.stdout


def _readme_train_example() -> list[str]:
    """The README's full `vime train` example (its first line starts with the command), which
    docs/train.md shows too."""
    blocks = [(REPO / page).read_text().split("```bash\nvime train --hf-checkpoint", 1)[1]
              .split("\nvime train", 1)[0] for page in ("README.md", "docs/train.md")]
    assert blocks[0] == blocks[1], "README.md and docs/train.md show two own-data examples"
    return shlex.split(("--hf-checkpoint" + blocks[0]).replace("\\\n", " "))


def test_dry_run_on_the_readme_example(tmp_path, capsys):
    """The README's example, only its paths pointed at local files, runs the whole dry run on
    a tiny model of Qwen2.5-0.5B-Instruct's shape (tied embeddings, byte-level BPE, the Qwen
    chat template, a base EOS, a 32768-token context: its 1024/2048-token limits fit)."""
    from vime_shell.models.chat_model import build_chat_model

    model = build_chat_model(tmp_path / "Qwen-tiny", tie_word_embeddings=True, vocab_multiple=8,
                             eos_token="<|endoftext|>", max_position_embeddings=32768)
    argv = _readme_train_example()
    rows = "".join(json.dumps({"prompt": f"What is {a} + 1? Put the final answer in "
                               "\\boxed{}.", "answer": str(a + 1)}) + "\n" for a in range(8))
    for path in ("train.jsonl", "test.jsonl"):
        (tmp_path / path).write_text(rows)
    pq.write_table(pa.Table.from_pylist([json.loads(r) for r in rows.splitlines()]),
                   tmp_path / "math500.parquet")
    local = {"/models/Qwen2.5-0.5B-Instruct": str(model), "ck": str(tmp_path / "ck"),
             "runs/qwen-math": str(tmp_path / "run")}
    argv = [local.get(a, str(tmp_path / a) if a.endswith((".jsonl", ".parquet")) else a)
            for a in argv]
    status, err = _exit(["--dry-run", *argv], capsys)
    assert status == 0, err


def test_config_file_by_section_and_section_views(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("loss:\n  eps_clip: 0.1\noptimizer:\n  lr: 1.0e-5\nseed: 3\n")
    args = type("A", (), {})()
    args.__dict__.update(config=str(path))
    cfg = config_from_args(args)
    assert (cfg.eps_clip, cfg.lr, cfg.seed) == (0.1, 1e-5, 3)
    assert cfg.section("loss")["eps_clip"] == 0.1 and "lr" not in cfg.section("loss")
    path.write_text("loss:\n  lr: 1.0e-5\n")
    with pytest.raises(ConfigError, match="belongs to section 'optimizer'"):
        config_from_args(args)


# --- a flag at its default no-op value is never an error -----------------------------------
# slime's default of each flag, as a script would type it. Where slime has none, Megatron's
# (slime passes Megatron's flags through), then miles'. Sources:
#   s  = THUDM/slime slime/utils/arguments.py at 624b824
#   mi = radixark/miles miles/utils/arguments.py at 31f1ca9
#   m  = NVIDIA/Megatron-LM megatron/training/arguments.py at d98e8a64
#   mc = megatron-core 0.16.1's TransformerConfig field defaults (Megatron builds those flags
#        from the dataclass: ArgumentGroupFactory)
# A flag whose default is None or an unset store_true has no value to type: it is absent here
# and, when vime accepts it, tried at vime's own default (a bool as --no-X / --X).
SLIME_DEFAULTS: dict[str, str] = {
    "--rollout-num-gpus-per-engine": "1", "--update-weight-buffer-size": str(512 * 1024**2),
    "--input-key": "input", "--metadata-key": "metadata", "--tool-key": "tools",  # s
    "--rollout-seed": "42", "--update-weights-interval": "1",  # s
    "--rollout-function-path": "slime.rollout.sglang_rollout.generate_rollout",  # s
    "--n-samples-per-prompt": "1", "--rollout-temperature": "1.0", "--rollout-top-p": "1.0",
    "--rollout-top-k": "-1", "--advantage-estimator": "grpo",  # s
    "--n-samples-per-eval-prompt": "1", "--micro-batch-size": "1", "--eps-clip": "0.2",  # s
    "--kl-coef": "0.0", "--kl-loss-coef": "0.0", "--kl-loss-type": "k1",  # s
    "--entropy-coef": "0.0", "--tis-clip": "2.0", "--tis-clip-low": "0", "--lr": "1e-6",  # s
    "--seed": "1234", "--clip-grad": "1.0", "--log-probs-chunk-size": "-1",  # s
    "--min-lr": "0.0", "--weight-decay": "0.01", "--adam-beta1": "0.9",  # m
    "--adam-beta2": "0.999", "--adam-eps": "1e-08", "--optimizer": "adam",  # m
    "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "1",  # mc
    "--context-parallel-size": "1", "--expert-model-parallel-size": "1",  # mc
    "--expert-tensor-parallel-size": "1",  # mc: None (= TP); slime's scripts pass 1
    "--moe-router-topk": "2", "--moe-token-dispatcher-type": "allgather",  # mc
    "--moe-router-score-function": "softmax", "--moe-token-drop-policy": "probs",  # mc
    "--moe-router-bias-update-rate": "0.001", "--transformer-impl": "transformer_engine",  # mc
    "--attention-backend": "auto",  # mc
    "--moe-aux-loss-coeff": "0.0", "--moe-router-load-balancing-type": "aux_loss",  # m
    "--moe-layer-freq": "1", "--rotary-scaling-factor": "1.0", "--mscale": "1.0",  # m
    "--mscale-all-dim": "0.0", "--make-vocab-size-divisible-by": "128",  # m
    "--qkv-format": "thd", "--megatron-to-hf-mode": "raw",  # mi
    "--update-weight-transfer-mode": "broadcast",  # mi
    "--data-pad-size-multiplier": "128", "--train-backend": "megatron",  # s
    "--loss-mask-type": "qwen",  # s
    "--update-weight-mode": "full", "--update-weight-transport": "nccl",  # s
    "--update-weight-delta-encoding": "xor", "--update-weight-delta-checksum": "xxh3-128",  # s
    "--actor-num-nodes": "1", "--actor-num-gpus-per-node": "8", "--num-gpus-per-node": "8",
    # refused features, at the value that leaves them off
    "--loss-type": "policy_loss", "--opd-kl-coef": "1.0", "--train-env-vars": "{}",  # s
    "--opd-teacher-key": "opd_teacher", "--opd-log-prob-top-k": "0",  # mi
    "--opd-reward-weight-mode": "student_p", "--opd-top-k-strategy": "only-student",  # mi
    "--lora-rank": "0", "--lora-alpha": "16", "--lora-dropout": "0.0",  # mi (vime's own now)
    "--muon-momentum": "0.9", "--muon-scale-mode": "spectral",  # m
    "--muon-fp32-matmul-prec": "medium", "--muon-num-ns-steps": "5",  # m
    "--muon-extra-scale-factor": "1.0",  # m (--muon-tp-mode: 0.16's blockwise, main's
    "--muon-tp-mode": "duplicated",  # duplicated, vime's default; both accepted)
    "--kv-lora-rank": "32", "--qk-head-dim": "128",  # m: MLA's, vime's own now (checked
    "--qk-pos-emb-head-dim": "64", "--v-head-dim": "128",  # against an MLA config only)
    "--fp8-recipe": "delayed",  # mc
}
# Refused flags with no value to type at their default (a store_true, or None): nothing to try.
NO_TYPED_DEFAULT = {
    "--use-fault-tolerance",
    "--fp8-format", "--fp8-param-gather",
    "--multimodal-keys", "--filter-zero-reward-samples",
    "--critic-num-nodes", "--critic-num-gpus-per-node",
}
# Not no-ops, so outside the rule: Megatron's default is a statement about the model (the
# architecture flags are checked against config.json: --no-swiglu on a SwiGLU checkpoint is a
# mismatch), or a setting vime cannot train with (Megatron's default dropout 0.1, which
# slime's scripts turn off: "default dropout in megatron is 0.1").
NOT_NO_OPS = {*(f"--{f.name.replace('_', '-')}" for f in attrs.fields(ModelArchArgs)),
              "--attention-dropout", "--hidden-dropout"}
# slime's default that makes the job another shape: what else it needs in vime (slime's own
# --global-batch-size default is Megatron's micro-batch x DP; vime's is 128 groups).
WITH = {"--n-samples-per-prompt": ["--global-batch-size", "16"]}
# Placement defaults describe the world they launch: slime's 8 GPUs is an 8-rank torchrun.
WORLD = {"--actor-num-gpus-per-node": "8", "--num-gpus-per-node": "8"}
NOT_FLAGS = {"--help", "--config", "--custom-config-path", "--dry-run", "--wandb-key", "--load-forge-rollout-data"}


def _train_flags() -> dict[str, argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {s: a for a in sub.choices["train"]._actions for s in a.option_strings
            if s.startswith("--") and not s.startswith("--no-") and s not in NOT_FLAGS}


def _at_default(flag: str, action: argparse.Action) -> list[str] | None:
    """The words that pass ``flag`` at slime's default, else at vime's; None: none to type."""
    if flag in SLIME_DEFAULTS:
        return [flag, SLIME_DEFAULTS[flag]]
    default = attrs.fields_dict(TrainConfig)[action.dest].default
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag] if default else [f"--no-{flag[2:]}"]
    if default is None:
        return None
    return [flag, *(map(str, default) if isinstance(default, tuple) else [str(default)])]


def test_the_table_of_slime_defaults_covers_every_refused_flag():
    known = {*_train_flags(), *UNSUPPORTED}
    assert set(SLIME_DEFAULTS) <= known, set(SLIME_DEFAULTS) - known
    untyped = set(UNSUPPORTED) - set(SLIME_DEFAULTS) - NO_TYPED_DEFAULT
    assert not untyped, f"add slime's default of {sorted(untyped)} to SLIME_DEFAULTS"


@pytest.mark.parametrize("stand_in", ["dense", "moe"])
def test_flag_at_its_default_no_op_value_is_never_an_error(stand_in, model, moe_model,
                                                           tmp_path, capsys, monkeypatch):
    """Every flag vime accepts, and every flag it refuses, at slime's default (Megatron's or
    miles' where slime has none; vime's own where neither has one) on a dense and a MoE
    stand-in: the dry run passes."""
    hf = model if stand_in == "dense" else moe_model
    cases = {f: _at_default(f, a) for f, a in _train_flags().items() if f not in NOT_NO_OPS}
    cases.update({f: [f, v] for f, v in SLIME_DEFAULTS.items() if f in UNSUPPORTED})
    failed = []
    for n, (flag, words) in enumerate(cases.items()):
        if words is None:
            continue
        with monkeypatch.context() as env:
            if flag in WORLD:
                env.setenv("WORLD_SIZE", WORLD[flag])
                env.setenv("LOCAL_WORLD_SIZE", WORLD[flag])
            status, err = _exit(["--dry-run", "--hf-checkpoint", str(hf), "--run-dir",
                                 str(tmp_path / str(n)), *words, *WITH.get(flag, [])], capsys)
        if status != 0:
            failed.append(f"{' '.join(words)}: {err.splitlines()[-1]}")
    assert not failed, "\n".join(failed)


def test_expert_tensor_parallel_size_1_is_a_no_op_on_a_dense_model(model, monkeypatch,
                                                                   capsys, tmp_path):
    """slime's dense Qwen3-4B script: TP 2 with --expert-tensor-parallel-size 1 (the issue's
    case). A dense model has no experts to split; EP above 1 still names the mistake."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    argv = ["--dry-run", "--hf-checkpoint", str(model), "--run-dir", str(tmp_path / "r"),
            "--tensor-model-parallel-size", "2"]
    status, err = _exit([*argv, "--expert-tensor-parallel-size", "1",
                         "--expert-model-parallel-size", "1"], capsys)
    assert status == 0, err
    cfg = parse_train_config(argv[1:] + ["--expert-tensor-parallel-size", "1"])
    assert launch_checks(cfg, model).layout.etp == 2  # dense: the expert grid is the TP grid
    status, err = _exit([*argv, "--expert-model-parallel-size", "2"], capsys)
    assert status == 2 and "--expert-model-parallel-size=2: the model has no experts" in err


def test_unsupported_flag_at_slimes_default_is_a_note_and_at_another_value_its_line(capsys,
                                                                                   tmp_path):
    status, err = _exit(["--dry-run", "--run-dir", str(tmp_path), "--fp8-recipe", "delayed",
                         "--loss-type=policy_loss"], capsys)
    assert status == 0, err
    assert f"note: --fp8-recipe delayed: slime's default, a no-op (not supported in vime: " \
        f"{FP8})" in err
    assert "--loss-type" not in err  # a flag of vime's own now (policy_loss, sft_loss)
    status, err = _exit(["--fp8-recipe", "blockwise", "--dry-run", "--run-dir",
                         str(tmp_path)], capsys)
    assert (status, err) == (2, f"vime train: error: --fp8-recipe: not supported in vime ({FP8})")
    assert default_flags(["--fp8-recipe", "delayed", "--lr", "1"]) == (
        [f"--fp8-recipe delayed: slime's default, a no-op (not supported in vime: {FP8})"],
        ["--lr", "1"])


def test_mtp_num_layers_is_checked_against_the_checkpoint(capsys, tmp_path):
    """The checkpoint's MTP layers are carried, not trained: a count it does not have is an
    error naming both (0, slime's default, is the count of a model without them)."""
    status, err = _exit(["--mtp-num-layers", "0", "--dry-run", "--run-dir", str(tmp_path)],
                        capsys)
    assert status == 0, err
    status, err = _exit(["--mtp-num-layers", "1", "--dry-run", "--run-dir", str(tmp_path)],
                        capsys)
    assert status == 2 and "--mtp-num-layers=1: does not match" in err and \
        "mtp_num_hidden_layers / num_nextn_predict_layers" in err, err


def test_slimes_spellings_of_values_become_vimes(capsys, tmp_path):
    """slime's default rollout function, Megatron's default dispatcher, SGLang's top-k -1 and
    slime's log-probs chunk -1 (no chunking) are vime's own values."""
    cfg = parse_train_config(["--rollout-function-path",
                              "slime.rollout.sglang_rollout.generate_rollout",
                              "--moe-token-dispatcher-type", "allgather", "--rollout-top-k",
                              "-1", "--eval-top-k", "-1", "--log-probs-chunk-size", "-1"])
    assert (cfg.rollout_function_path, cfg.moe_token_dispatcher_type, cfg.rollout_top_k,
            cfg.eval_top_k, cfg.log_probs_chunk_size) == (
        DEFAULT_ROLLOUT_FUNCTION, "alltoall", 0, 0, None)
    status, err = _exit(["--dry-run", "--run-dir", str(tmp_path), "--rollout-function-path",
                         "slime.rollout.sglang_rollout.generate_rollout"], capsys)
    assert status == 0 and "slime's default rollout function" in err, err
    status, err = _exit(["--rollout-top-k", "-2"], capsys)
    assert status == 2 and "--rollout-top-k=-2" in err


def test_precision_aware_optimizer_turns_on_distributed_optimizer(capsys, tmp_path):
    """Megatron needs the distributed optimizer under --use-precision-aware-optimizer and
    --overlap-param-gather; slime turns it on always, so its scripts never pass it. vime turns
    it on for them, with a note (its default stays off: a checkpoint records which optimizer
    wrote it, and resuming needs the same)."""
    for flag in ("--use-precision-aware-optimizer", "--overlap-param-gather"):
        cfg = parse_train_config([flag])
        assert not cfg.use_distributed_optimizer
        assert trainer_config(cfg).optim.use_distributed_optimizer, flag
        status, err = _exit(["--dry-run", "--run-dir", str(tmp_path / flag), flag], capsys)
        assert status == 0, err
        assert f"note: {flag}: turns on the distributed optimizer" in err
    assert not trainer_config(TrainConfig()).optim.use_distributed_optimizer
    said = parse_train_config(["--use-precision-aware-optimizer", "--use-distributed-optimizer"])
    assert said.distributed_optimizer_needed_by(True) is None  # given: no note


def test_moe_router_load_balancing_type_none_is_a_choice(moe_model, capsys, tmp_path):
    """slime's MiniMax-M2 model args pass it; "none" was read as unset before the choice
    check. Every choice list with a "none" member keeps it as a value."""
    cfg = parse_train_config(["--moe-router-load-balancing-type", "none"])
    assert cfg.moe_router_load_balancing_type == "none"
    status, err = _exit(["--dry-run", "--hf-checkpoint", str(moe_model), "--run-dir",
                         str(tmp_path), "--moe-router-load-balancing-type", "none"], capsys)
    assert status == 0, err
    with_none = [f for f in attrs.fields(TrainConfig) if "none" in (f.metadata["choices"] or ())]
    for f in with_none:
        flag = "--" + f.name.replace("_", "-")
        assert getattr(parse_train_config([flag, "none"]), f.name) == "none", flag
    assert parse_train_config(["--moe-router-dtype", "none"]).moe_router_dtype is None  # unset


def test_single_eval_prompt_path_is_slimes_legacy_aime_set(tmp_path, capsys):
    """slime: "[legacy] only one eval_prompt_data detected, will assume it is data for aime"
    (slime/utils/arguments.py); its Qwen3-30B-A3B int4 script passes one path."""
    path = tmp_path / "aime-2024.jsonl"
    path.write_text(json.dumps({"prompt": "1+1", "label": "2"}) + "\n")
    assert parse_train_config(["--eval-prompt-data", str(path)]).eval_prompt_data == (
        "aime", str(path))
    status, err = _exit(["--dry-run", "--run-dir", str(tmp_path / "r"), "--eval-prompt-data",
                         str(path)], capsys)
    assert status == 0, err
    assert (f"note: --eval-prompt-data {path}: one path is slime's legacy form, an eval set "
            "named aime") in err
    config = tmp_path / "c.yaml"
    config.write_text(f"eval_prompt_data: {path}\n")
    args = argparse.Namespace(config=str(config))
    assert config_from_args(args).eval_prompt_data == ("aime", str(path))
    status, err = _exit(["--eval-prompt-data", "a", "a.jsonl", "b"], capsys)
    assert status == 2 and "is not NAME PATH pairs" in err  # three words: no legacy form


def test_wandb_flags_are_slimes(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    config = tmp_path / "c.yaml"
    config.write_text("wandb_key: from-a-config-file\nuse_wandb: true\n")
    cfg = config_from_args(argparse.Namespace(config=str(config)))
    assert os.environ["WANDB_API_KEY"] == "from-a-config-file"  # monkeypatch restores it
    assert "from-a-config-file" not in json.dumps(cfg.to_dict())
    cfg = parse_train_config(["--use-wandb", "--wandb-team", "t", "--wandb-host", "https://h",
                              "--wandb-run-id", "r1", "--wandb-dir", "wd",
                              "--disable-wandb-random-suffix", "--wandb-always-use-train-step",
                              "--wandb-group", "g"])
    assert (cfg.wandb_team, cfg.wandb_host, cfg.wandb_run_id, cfg.wandb_dir) == (
        "t", "https://h", "r1", "wd")
    assert wandb_names("g", True) == ("g", "g")
    group, name = wandb_names("g", False)  # slime: a random 6-character suffix
    assert re.fullmatch(r"g_[0-9a-f]{6}", group) and name == f"{group}-RANK_0"


def test_wandb_key_reaches_wandb_only_through_its_environment(tmp_path):
    """A one-rollout run with W&B offline and a key: the key is in WANDB_API_KEY (where W&B
    reads it) and in no file the run writes (metrics, checkpoint, lock and owner records,
    W&B's own run files, which record the command line), nor in its output or dry-run
    report."""
    key = "vime-test-key-3f9c0d7e1b2a"
    code = ("import hashlib, os, sys; from vime_shell.cli.main import main; "
            "rc = main(sys.argv[1:]); print('KEY-IN-ENV', hashlib.sha256(os.environ.get("
            "'WANDB_API_KEY', '').encode()).hexdigest()); sys.exit(rc)")
    in_env = f"KEY-IN-ENV {hashlib.sha256(key.encode()).hexdigest()}"
    common = ["--use-wandb", "--wandb-mode", "offline", "--wandb-key", key, "--wandb-group",
              "g", "--num-rollout", "1", "--rollout-batch-size", "4", "--n-samples-per-prompt",
              "2", "--global-batch-size", "8"]
    # HOME is the test's (W&B writes there); the embedded model comes from the usual cache
    env = {"PYTHONPATH": str(REPO / "src"), "PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1",
           "HOME": str(tmp_path), "WANDB_SILENT": "true",
           "VIME_CACHE_DIR": str(default_cache_dir())}
    outputs = []
    for extra in (["--dry-run", "--run-dir", "dry"],
                  ["--run-dir", "run", "--save", "ck", "--save-interval", "1"]):
        out = subprocess.run([sys.executable, "-c", code, "train", *common, *extra],
                             capture_output=True, text=True, cwd=tmp_path, env=env,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert in_env in out.stdout, out.stdout[-500:]
        outputs += [out.stdout, out.stderr]
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*")), "W&B ran"
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").is_file()
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(written) > 10
    leaks = [str(p) for p in written if key.encode() in p.read_bytes()]
    leaks += [f"output {i}" for i, text in enumerate(outputs) if key in text]
    assert not leaks, leaks
    assert redact(["train", "--wandb-key", key, "--wandb-key=" + key, "--lr", "1"]) == [
        "train", "--wandb-key", "***", "--wandb-key=***", "--lr", "1"]


def test_slimes_int4_qat_switch_in_the_environment_is_refused(capsys, tmp_path, monkeypatch):
    """slime turns int4 QAT on through its job's environment, not a flag: vime refuses it at
    launch rather than train in bf16 as if it were not there."""
    monkeypatch.setenv("OPEN_TRAINING_INT4_FAKE_QAT_FLAG", "1")
    status, err = _exit(["--dry-run", "--run-dir", str(tmp_path)], capsys)
    assert status == 2
    assert "OPEN_TRAINING_INT4_FAKE_QAT_FLAG='1': is set in the environment: not supported " \
        "in vime (int4 quantisation-aware training" in err


def test_the_anchors_built_in_plugin_paths_are_vimes_counterparts(capsys, tmp_path):
    """slime's and miles' own filter, miles' SFT rollout, and slime's fully-async rollout
    function (vime's --fully-async mode), each with its launch note."""
    for anchor in ("slime", "miles"):
        path = f"{anchor}.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"
        cfg = parse_train_config(["--dynamic-sampling-filter-path", path])
        assert cfg.dynamic_sampling_filter_path == "vime_shell.rollout.filters:nonzero_reward_std"
        cfg = parse_train_config(["--rollout-function-path",
                                  f"{anchor}.rollout.sft_rollout.generate_rollout",
                                  "--loss-type", "sft_loss", "--global-batch-size", "16"])
        assert cfg.rollout_function_path == "vime_shell.rollout.sft:sft_rollout"
    fully = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
    cfg = parse_train_config(["--rollout-function-path", fully])
    assert cfg.fully_async and cfg.rollout_function_path.endswith(":single_turn_rollout")
    status, err = _exit(["--rollout-function-path", fully, "--dry-run", "--run-dir",
                         str(tmp_path)], capsys)
    # the mode's own launch check: one process has no rank to spare for the pools
    assert status == 2 and "--fully-async runs engines on ranks of their own" in err, err
