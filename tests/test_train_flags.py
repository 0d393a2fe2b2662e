"""Every ``vime train`` flag group reaches the object it configures, and a bad value of each
exits with status 2 and one line naming the flag (before anything heavy is built)."""

import json
import logging

import pytest

from vime_pure import LossMode
from vime_shell.cli.main import main
from vime_shell.loop.config import SECTIONS, TrainConfig, parse_train_config
from vime_shell.loop.launch_checks import launch_checks
from vime_shell.loop.logs import configure_logging
from vime_shell.loop.loop import trainer_config
from vime_shell.models.embedded import build_embedded
from vime_shell.rollout.rewards import Rewarder


@pytest.fixture(autouse=True)
def fresh_cwd(tmp_path, monkeypatch):
    """Default run directories (runs/demo) resolve under a fresh directory, not the checkout,
    where a demo run would make the launch checks refuse to reuse them."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_embedded(tmp_path_factory.mktemp("embedded"))


@pytest.fixture
def data(tmp_path):
    rows = [{"q": f"{a}+1", "a": str(a + 1), "m": {"k": a}} for a in range(8)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _bad(argv, capsys, flag):
    try:
        status = main(["train", *argv])
    except SystemExit as exc:  # argparse's own checks (choices, types) exit from the parser
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err, err


def test_help_is_grouped_into_sections_with_choices(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for section in SECTIONS:
        assert f"\n{section}:\n" in out
    assert "{group_token_mean,sample_token_mean,token_mean,sample_token_sum_norm}" in out


def test_data_and_eval_flags_reach_the_prompt_source_and_eval_sets(model, data, capsys):
    cfg = parse_train_config(["--prompt-data", data, "--input-key", "q", "--label-key", "a",
                              "--metadata-key", "m", "--rollout-max-response-len", "2",
                              "--eval-prompt-data", "sums", data, "--eval-interval", "3",
                              "--apply-chat-template", "--rollout-shuffle"])
    plan = launch_checks(cfg, model)
    assert plan.prompts[2].prompt == "2+1" and plan.prompts[2].metadata == {"k": 2}
    assert [name for name, _ in plan.eval_sets] == ["sums"] and plan.task is None
    epochs = parse_train_config(["--prompt-data", data, "--input-key", "q", "--label-key", "a",
                                 "--rollout-max-response-len", "2", "--num-epoch", "3",
                                 "--rollout-batch-size", "4", "--global-batch-size", "32"])
    assert launch_checks(epochs, model).num_rollout == 6  # 3 passes over 8 rows, 4 per rollout
    _bad(["--prompt-data", data, "--input-key", "question", "--rollout-max-response-len", "2"],
         capsys, "train.jsonl:1: no 'question' field")
    _bad(["--prompt-data", data], capsys, "rollout_max_response_len")
    _bad(["--eval-prompt-data", "sums"], capsys, "eval_prompt_data")


def test_rollout_and_reward_flags(model, capsys):
    cfg = parse_train_config(["--rm-type", "math", "--over-sampling-batch-size", "32",
                              "--dynamic-sampling-filter-path",
                              "vime_shell.rollout.filters:nonzero_reward_std",
                              "--rollout-top-k", "5", "--n-samples-per-prompt", "4",
                              "--global-batch-size", "64"])
    assert (cfg.over_sampling_batch_size, cfg.rollout_top_k) == (32, 5)
    assert Rewarder.build(rm_type=cfg.rm_type).name == "math"
    launch_checks(cfg, model)
    _bad(["--rm-type", "gpt"], capsys, "--rm-type")
    _bad(["--over-sampling-batch-size", "32"], capsys, "over_sampling_batch_size")
    _bad(["--dynamic-sampling-filter-path", "nowhere:fn"], capsys,
         "--dynamic-sampling-filter-path")


def test_loss_flags_reach_the_trainer_config(capsys):
    cfg = parse_train_config(["--use-kl-loss", "--kl-loss-coef", "0.05", "--kl-loss-type", "k2",
                              "--eps-clip-high", "0.28", "--entropy-coef", "0.01", "--use-tis",
                              "--tis-clip", "3", "--calculate-per-token-loss"])
    loss = trainer_config(cfg).loss
    assert (loss.kl_coef, loss.kl_kind, loss.eps_clip_high) == (0.05, "k2", 0.28)
    assert (loss.entropy_coef, loss.use_tis, loss.tis_clip) == (0.01, True, 3.0)
    assert LossMode(cfg.effective_loss_mode) is LossMode.TOKEN_MEAN
    assert trainer_config(TrainConfig(kl_loss_coef=0.0)).loss.kl_coef == 0.0
    _bad(["--kl-loss-coef", "0.1"], capsys, "kl_loss_coef")
    _bad(["--kl-loss-type", "k9"], capsys, "--kl-loss-type")
    _bad(["--loss-mode", "mean_of_means"], capsys, "--loss-mode")


def test_optimizer_flags_reach_the_trainer_config(capsys):
    cfg = parse_train_config(["--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "2",
                              "--lr-decay-iters", "10", "--lr-decay-style", "cosine",
                              "--weight-decay", "0.1", "--clip-grad", "0.5", "--adam-beta1",
                              "0.8", "--adam-beta2", "0.95", "--use-distributed-optimizer",
                              "--num-steps-per-rollout", "2"])
    optim = trainer_config(cfg).optim
    assert cfg.effective_global_batch_size == 64  # 16 prompts x 8 samples / 2 steps
    assert (optim.lr_warmup_groups, optim.lr_decay_groups) == (128, 640)  # steps x 64 groups
    assert (optim.min_lr, optim.lr_decay_style, optim.weight_decay) == (1e-5, "cosine", 0.1)
    assert (optim.clip_grad, optim.adam_beta1, optim.adam_beta2) == (0.5, 0.8, 0.95)
    assert optim.use_distributed_optimizer
    _bad(["--lr", "0"], capsys, "lr=0")
    _bad(["--min-lr", "1"], capsys, "min_lr")
    _bad(["--num-steps-per-rollout", "3"], capsys, "num_steps_per_rollout")
    _bad(["--overlap-param-gather"], capsys, "overlap_param_gather")


def test_batching_and_parallelism_flags(model, capsys, monkeypatch):
    cfg = parse_train_config(["--packing", "first_fit", "--balance", "straggler"])
    policy = cfg.batching_policy()
    assert (policy.packing, policy.balance) == ("first_fit", "straggler")
    monkeypatch.setenv("WORLD_SIZE", "2")
    plan = launch_checks(parse_train_config(["--pipeline-model-parallel-size", "2"]), model)
    assert (plan.layout.pp, plan.layout.dp) == (2, 1)
    _bad(["--micro-batch-size", "2"], capsys, "micro_batch_size=2")
    _bad(["--context-parallel-size", "2"], capsys, "context_parallel_size=2")
    _bad(["--balance", "round_robin"], capsys, "--balance")


def test_logging_flags(model, capsys):
    cfg = parse_train_config(["--log-level", "debug", "--use-wandb", "--wandb-mode", "offline"])
    launch_checks(cfg, model)  # wandb is installed with the test extra
    log = configure_logging(cfg.log_level, rank=3)
    log.getChild("train").debug("step 0")
    assert "vime train [rank 3]: step 0" in capsys.readouterr().err
    quiet = configure_logging("info", rank=3)
    quiet.getChild("train").info("hidden on rank 3")
    assert "hidden" not in capsys.readouterr().err
    assert quiet.level == logging.INFO
    _bad(["--log-level", "loud"], capsys, "--log-level")


def test_off_policy_correction_flags(capsys):
    """slime's TIS flags reach the trainer; the --use-rs band defaults to the TIS clamp (as
    in slime's mis.py) and its settings are refused without --use-rs."""
    cfg = parse_train_config(["--use-tis", "--tis-clip", "5", "--tis-clip-low", "0.5",
                              "--use-rs", "--rs-level", "geometric", "--rs-denominator",
                              "surviving"])
    loss = trainer_config(cfg).loss
    assert (loss.use_tis, loss.tis_clip, loss.tis_clip_low) == (True, 5.0, 0.5)
    rs = cfg.rejection_config()
    assert (rs.level, rs.lower, rs.upper, rs.denominator) == ("geometric", 0.5, 5.0, "surviving")
    assert parse_train_config(["--use-rs", "--rs-upper-bound", "1.5"]).rejection_config(
    ).upper == 1.5
    assert TrainConfig().rejection_config() is None
    _bad(["--rs-level", "sequence"], capsys, "rs_level")
    _bad(["--use-rs", "--rs-level", "word"], capsys, "--rs-level")
    _bad(["--tis-clip-low", "3"], capsys, "tis_clip_low")
    _bad(["--use-rs", "--rs-lower-bound", "3"], capsys, "rs_lower_bound")
