"""slime's flags on ``vime train``, per flag group: each value reaches the object it configures,
a bad value exits 2 with one line before torch is imported, and a flag vime does not support
prints its table line (never a misleading did-you-mean)."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vime_shell.cli.main import main
from vime_shell.engines.layout import DEFAULT_GPU_MEMORY_UTILIZATION
from vime_shell.loop.checkpoint_index import resume_checkpoint
from vime_shell.loop.config import ConfigError, TrainConfig
from vime_shell.loop.config_flags import config_from_args, parse_train_config
from vime_shell.loop.launch_checks import launch_checks, model_dir
from vime_shell.loop.components import engine_options, trainer_config
from vime_shell.loop.slime_flags import UNSUPPORTED, engine_flags
from vime_shell.models.embedded import build_embedded

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model():
    return build_embedded()


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
    assert out.stderr.strip() == ("vime train: error: --eps-clip=0.0: must lie in (0, 1). "
                                  "Fix: use e.g. 0.2.")


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


@pytest.mark.parametrize("flag", ["--use-opd", "--lora-rank", "--multi-latent-attention",
                                  "--lora-alpha", "--spec"])
def test_unsupported_flag_prints_its_table_line(flag, capsys):
    status, err = _exit([flag, "1"], capsys)
    assert status == 2
    assert err == f"vime train: error: {flag}: not supported in vime ({UNSUPPORTED[flag]})"


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
    """The README's full `vime train` example (its first line starts with the command)."""
    text = (REPO / "README.md").read_text()
    block = text.split("```bash\nvime train --hf-checkpoint", 1)[1].split("\nvime train", 1)[0]
    return shlex.split(("--hf-checkpoint" + block).replace("\\\n", " "))


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
