"""Every ``vime train`` flag group reaches the object it configures, and a bad value of each
exits with status 2 and one line naming the flag (before anything heavy is built)."""

import json
import logging
import shutil

import attrs
import pytest

from vime_pure import LossMode
from vime_shell.cli import train as train_cmd
from vime_shell.cli.main import main
from vime_shell.cli.parser import as_flags
from vime_shell.models.embedded import build_embedded
from vime_shell.rollout import functions
from vime_shell.rollout.data import DataError
from vime_shell.rollout.rewards import Rewarder
from vime_shell.run.components import trainer_config
from vime_shell.run.launch_checks import launch_checks
from vime_shell.run.logs import configure_logging
from vime_shell.settings.flags import parse_train_config
from vime_shell.settings.train_config import SECTIONS, ConfigError, TrainConfig


@pytest.fixture(autouse=True)
def fresh_cwd(tmp_path, monkeypatch):
    """Default run directories (runs/train) resolve under a fresh directory, not the checkout,
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
    lines = capsys.readouterr().err.strip().splitlines()
    # One line naming the flag; a chained cause that adds something is one more line.
    assert flag in lines[0] and (len(lines) == 1 or len(lines) == 2
                                 and lines[1].startswith("vime train: caused by: ")), lines


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
    _bad(["--prompt-data", data], capsys, "--rollout-max-response-len")
    _bad(["--eval-prompt-data", "sums"], capsys, "--eval-prompt-data")


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
    _bad(["--over-sampling-batch-size", "32"], capsys, "--over-sampling-batch-size")
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
    _bad(["--kl-loss-coef", "0.1"], capsys, "--kl-loss-coef")
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
    # no --lr-decay-iters: the whole run, 300 rollouts x 2 steps x 64 groups
    whole = parse_train_config(["--lr-decay-style", "cosine", "--num-steps-per-rollout", "2"])
    assert trainer_config(whole).optim.lr_decay_groups == 300 * 2 * 64
    assert (optim.min_lr, optim.lr_decay_style, optim.weight_decay) == (1e-5, "cosine", 0.1)
    assert (optim.clip_grad, optim.adam_beta1, optim.adam_beta2) == (0.5, 0.8, 0.95)
    assert optim.use_distributed_optimizer
    _bad(["--lr", "0"], capsys, "--lr=0")
    _bad(["--min-lr", "1"], capsys, "--min-lr")
    _bad(["--num-steps-per-rollout", "3"], capsys, "--num-steps-per-rollout")
    # Megatron needs the distributed optimizer for it: on without the flag (slime's default)
    assert trainer_config(parse_train_config(["--overlap-param-gather"])
                          ).optim.use_distributed_optimizer


def test_batching_and_parallelism_flags(model, capsys, monkeypatch):
    cfg = parse_train_config(["--packing", "first_fit", "--balance", "straggler"])
    policy = cfg.batching_policy()
    assert (policy.packing, policy.balance) == ("first_fit", "straggler")
    monkeypatch.setenv("WORLD_SIZE", "2")
    plan = launch_checks(parse_train_config(["--pipeline-model-parallel-size", "2"]), model)
    assert (plan.layout.pp, plan.layout.dp) == (2, 1)
    # slime's rule: --micro-batch-size without --use-dynamic-batch-size is static batching
    static = parse_train_config(["--micro-batch-size", "2"]).batching_policy()
    assert (static.micro_batch_size, static.max_tokens_per_gpu) == (2, None)
    _bad(["--micro-batch-size", "2", "--use-dynamic-batch-size"], capsys, "--micro-batch-size=2")
    _bad(["--context-parallel-size", "2"], capsys, "--context-parallel-size=2")
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
    _bad(["--rs-level", "sequence"], capsys, "--rs-level")
    _bad(["--use-rs", "--rs-level", "word"], capsys, "--rs-level")
    _bad(["--tis-clip-low", "3"], capsys, "--tis-clip-low")
    _bad(["--use-rs", "--rs-lower-bound", "3"], capsys, "--rs-lower-bound")


@pytest.mark.parametrize("argv, first, second", [
    (["--calculate-per-token-loss", "--loss-mode", "group_token_mean"],
     "--calculate-per-token-loss", "--loss-mode group_token_mean"),
    (["--calculate-per-token-loss", "--loss-mode", "sample_token_mean"],
     "--calculate-per-token-loss", "--loss-mode sample_token_mean"),
    (["--num-steps-per-rollout", "4", "--global-batch-size", "64"],
     "--num-steps-per-rollout 4", "--global-batch-size is 64"),
])
def test_conflicting_flags_exit_2_naming_both(argv, first, second, capsys):
    _bad(argv, capsys, first)
    _bad(argv, capsys, second)


def test_agreeing_flags_are_accepted():
    agree = parse_train_config(["--num-steps-per-rollout", "4", "--global-batch-size", "32"])
    assert agree.effective_global_batch_size == 32
    same = parse_train_config(["--calculate-per-token-loss", "--loss-mode", "token_mean"])
    assert same.effective_loss_mode == "token_mean"
    assert TrainConfig().effective_loss_mode == "group_token_mean"


def test_num_rollout_wins_over_num_epoch_as_in_slime(model, data):
    common = ["--prompt-data", data, "--input-key", "q", "--label-key", "a",
              "--rollout-max-response-len", "2", "--rollout-batch-size", "4",
              "--global-batch-size", "32", "--num-epoch", "3"]
    assert launch_checks(parse_train_config([*common, "--num-rollout", "2"]),
                         model).num_rollout == 2
    assert launch_checks(parse_train_config(common), model).num_rollout == 6
    assert TrainConfig().resolved_num_rollout(None) == 300


def test_eval_keys_and_sampling_overrides(model, data, tmp_path, capsys):
    other = tmp_path / "eval.jsonl"
    other.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    argv = ["--prompt-data", data, "--input-key", "q", "--label-key", "a",
            "--rollout-max-response-len", "2", "--eval-prompt-data", "other", str(other),
            "--eval-interval", "2"]
    plan = launch_checks(parse_train_config([*argv, "--eval-input-key", "question",
                                             "--eval-label-key", "answer"]), model)
    assert plan.eval_sets[0][1][0].prompt == "1+1" and plan.eval_sets[0][1][0].label == "2"
    _bad(argv, capsys, "Fix: pass --eval-input-key")
    from types import SimpleNamespace

    from vime_shell.sources.rollouts import RolloutProducer

    cfg = parse_train_config([*argv, "--rollout-stop", "</a>", "--rollout-top-p", "0.9",
                              "--eval-top-p", "0.5", "--eval-top-k", "4",
                              "--eval-stop-token-ids", "7", "--rollout-max-context-len", "64"])
    producer = SimpleNamespace(cfg=cfg, stop=(3,))
    train = RolloutProducer.sampling(producer, 2, 0)
    evals = RolloutProducer.sampling(producer, 2, 0, for_eval=True)
    assert (train.top_p, train.top_k, train.stop, train.stop_token_ids) == (0.9, 0, ("</a>",), (3,))
    assert (evals.top_p, evals.top_k, evals.stop, evals.stop_token_ids) == (0.5, 4, ("</a>",),
                                                                            (3, 7))
    assert evals.max_context_len == train.max_context_len == 64
    _bad(["--rollout-stop-token-ids", "-1"], capsys, "--rollout-stop-token-ids=-1")


def test_eval_config_gives_each_set_its_own_keys(model, data, tmp_path, capsys):
    (tmp_path / "aime.jsonl").write_text(json.dumps({"problem": "2+2", "answer": "4"}) + "\n")
    (tmp_path / "gsm.jsonl").write_text(json.dumps({"question": "1+2", "target": "3"}) + "\n")
    config = tmp_path / "evals.yaml"
    config.write_text("datasets:\n"
                      "  - {name: aime, path: aime.jsonl, input_key: problem, label_key: answer}\n"
                      "  - {name: gsm, path: gsm.jsonl, input_key: question, label_key: target}\n")
    argv = ["--prompt-data", data, "--input-key", "q", "--label-key", "a",
            "--rollout-max-response-len", "2", "--eval-interval", "2"]
    plan = launch_checks(parse_train_config([*argv, "--eval-config", str(config)]), model)
    assert [(n, rows[0].prompt, rows[0].label) for n, rows in plan.eval_sets] == [
        ("aime", "2+2", "4"), ("gsm", "1+2", "3")]
    config.write_text("datasets:\n  - {name: aime, file: aime.jsonl}\n")
    _bad([*argv, "--eval-config", str(config)], capsys, "datasets[0]")


# -- issue 19: inputs checked at launch, errors that name flags ------------------------------
def _rows(tmp_path, *lines: bytes) -> str:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return str(path)


GOOD = b'{"prompt": "12", "label": "3"}'


@pytest.mark.parametrize("line, message", [
    (b'{"prompt": "12", "label": null}', "d.jsonl:2: label is null"),
    (b'{"prompt": "12", "label": NaN}', "d.jsonl:2: label=nan is not a finite number"),
    (b'{"prompt": "12", "label": ["1", "x"]}', "is a list, but the built-in rewards"),
    (b'{"prompt": [{"role": "user", "content": "12"}], "label": "3"}',
     "d.jsonl:2: prompt is a list of 1 chat messages"),
    (b'{"prompt": "caf\xe9", "label": "3"}', "d.jsonl:2: byte 16 of the line is not UTF-8"),
    (b'{"prompt": "   ", "label": "3"}', "d.jsonl:2: prompt='   ' is blank"),
    (b'{"prompt": "hello", "label": "3"}', "d.jsonl:2: the prompt 'hello' gives no tokens: "
                                           "none of its characters is in the tokenizer's"),
    (b'{"prompt": "' + b"1" * 70 + b'", "label": "3"}',
     "d.jsonl:2: the prompt has 70 tokens, and with --rollout-max-response-len 2 it exceeds "
     "the model's context of 64 tokens")])
def test_bad_rows_fail_at_launch_in_one_line_naming_the_line(tmp_path, capsys, line, message):
    """Each used to surface 10-23 s in (after the model was built), as a raw traceback, or
    not at all (a stringified label, a transformers warning)."""
    _bad(["--prompt-data", _rows(tmp_path, GOOD, line), "--rollout-max-response-len", "2"],
         capsys, message)


def test_a_response_limit_past_the_context_offers_no_prompt_limit(tmp_path, capsys):
    # The embedded model's context is 64: a 1024-token response fits no prompt, so the fix is
    # the response limit (the prompt "12" is 2 tokens), never --rollout-max-prompt-len 1.
    code = main(["train", "--prompt-data", _rows(tmp_path, GOOD),
                 "--rollout-max-response-len", "1024"])
    err = capsys.readouterr().err
    assert code == 2 and "lower --rollout-max-response-len to at most 62." in err, err
    assert "--rollout-max-prompt-len" not in err


def test_rollout_max_prompt_len_drops_and_counts_long_prompts(model, tmp_path):
    long = b'{"prompt": "' + b"1" * 70 + b'", "label": "3"}'
    cfg = parse_train_config(["--prompt-data", _rows(tmp_path, GOOD, long, GOOD),
                              "--rollout-max-response-len", "2",
                              "--rollout-max-prompt-len", "10"])
    plan = launch_checks(cfg, model)
    assert plan.prompts_dropped == 1 and [e.prompt for e in plan.prompts] == ["12", "12"]
    with pytest.raises(ConfigError, match="--rollout-max-prompt-len|rollout_max_prompt_len=1: "
                                          "drops every prompt"):
        launch_checks(attrs.evolve(cfg, rollout_max_prompt_len=1), model)


@pytest.fixture
def templated(model, tmp_path):
    """A copy of the embedded model whose chat template the test writes."""
    copy = tmp_path / "model"
    shutil.copytree(model, copy)

    def write(template: str):
        (copy / "chat_template.jinja").write_text(template)
        return copy
    return write


def test_chat_templates_that_render_nothing_or_run_away_fail_at_launch(templated, tmp_path,
                                                                       monkeypatch):
    cfg = parse_train_config(["--prompt-data", _rows(tmp_path, GOOD), "--apply-chat-template",
                              "--rollout-max-response-len", "2"])
    with pytest.raises(DataError, match="d.jsonl:1: the prompt '12' gives no tokens"):
        launch_checks(cfg, templated("{% if false %}x{% endif %}"))
    # Nested loops that would render for hours stop at the time limit.
    monkeypatch.setattr(functions, "CHAT_TEMPLATE_TIMEOUT_S", 0.3)
    nested = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
    with pytest.raises(DataError, match=r"d.jsonl:1: the chat template did not render within "
                                        r"0.3 s"):
        launch_checks(cfg, templated(nested))
    with pytest.raises(DataError, match=r"d.jsonl:1: the chat template failed \("):
        launch_checks(cfg, templated("{{ raise_exception('no system prompt') }}"))


def test_seed_bound_and_duplicate_eval_names_are_refused(tmp_path, capsys):
    _bad(["--seed", str(2**63)], capsys, "--seed=9223372036854775808: must be below 2**63")
    _bad(["--rollout-seed", str(2**64)], capsys, "--rollout-seed=")
    data = _rows(tmp_path, GOOD)
    _bad(["--eval-prompt-data", "math", data, "math", data, "--eval-interval", "1"], capsys,
         "--eval-prompt-data=['math',")


def test_errors_name_flags_never_python_names(capsys):
    """The core's allow_partial_step is the user's --allow-partial-train-step."""
    _bad(["--global-batch-size", "3", "--rollout-batch-size", "1", "--n-samples-per-prompt",
          "2"], capsys, "--global-batch-size=3: does not divide the 2 groups of a rollout "
          "(--rollout-batch-size=1 x --n-samples-per-prompt=2)")
    assert main(["schedule", "--synthetic", "--num-groups", "3", "--global-batch-size", "8",
                 "--max-tokens-per-gpu", "4096"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "or set --allow-partial-train-step.")  # the core says allow_partial_step=True
    flags = {"--allow-partial-train-step", "--max-tokens-per-gpu", "--lr", "--use-kl-loss",
             "--no-use-kl-loss"}
    assert as_flags("Fix: set allow_partial_step=True.", flags) == \
        "Fix: set --allow-partial-train-step."
    assert as_flags("(max_tokens_per_gpu) lr=0 use_kl_loss=False", flags) == \
        "(--max-tokens-per-gpu) --lr=0 --no-use-kl-loss"
    # Words that are no flag, or one-word names without "=", and quoted keys stay as written.
    assert as_flags("before the first lr save; metadata['lr_x']=1", flags) == \
        "before the first lr save; metadata['lr_x']=1"


def _chained():
    try:
        raise TypeError("bad width")
    except TypeError as inner:
        raise ConfigError("global_batch_size=3: broken. Fix: x.") from inner


@pytest.mark.parametrize("fault, first, cause", [
    (OSError(28, "No space left on device", "ck/rollout_000004"),
     "OSError: [Errno 28] No space left on device: 'ck/rollout_000004'", None),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
     "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff", None),
    (None, "--global-batch-size=3: broken", "caused by: TypeError: bad width")])
def test_file_system_and_decoding_faults_are_one_line_with_the_cause(monkeypatch, capsys, fault,
                                                                     first, cause):
    """No raw traceback for a full disk or a bad byte; the cause is one more line, and the
    traceback appears only under --log-level debug."""
    def handler(args):
        if fault is None:
            _chained()
        raise fault

    monkeypatch.setattr(train_cmd, "run", handler)
    assert main(["train"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith(f"vime train: error: {first}")
    assert lines[1:] == ([] if cause is None else [f"vime train: {cause}"])
    assert main(["train", "--log-level", "debug"]) == 2
    assert "Traceback (most recent call last):" in capsys.readouterr().err


def test_check_flags_reach_what_they_configure(capsys):
    cfg = parse_train_config(["--reward-timeout", "5", "--skip-nonfinite-grad-steps",
                              "--no-logprob-check", "--rollout-max-prompt-len", "512"])
    assert (cfg.reward_timeout, cfg.logprob_check, cfg.rollout_max_prompt_len) == (5.0, False, 512)
    assert trainer_config(cfg).optim.skip_nonfinite_grad_steps
    assert parse_train_config([]).logprob_check and parse_train_config([]).reward_timeout is None
    _bad(["--reward-timeout", "0"], capsys, "--reward-timeout=0")
    _bad(["--rollout-max-prompt-len", "0"], capsys, "--rollout-max-prompt-len=0")


def test_a_temperature_vllm_refuses_fails_at_launch_for_the_vllm_engine():
    from vime_shell.run.launch_checks import check_engine_sampling

    with pytest.raises(ConfigError, match=r"rollout_temperature=3.0: is above vLLM's limit of "
                                          r"2. Fix: use at most 2, or --rollout-engine hf"):
        check_engine_sampling(TrainConfig(rollout_engine="vllm", rollout_temperature=3.0))
    with pytest.raises(ConfigError, match="eval_temperature=2.5"):
        check_engine_sampling(TrainConfig(rollout_engine="vllm", eval_temperature=2.5))
    check_engine_sampling(TrainConfig(rollout_engine="vllm", rollout_temperature=2.0))
    check_engine_sampling(TrainConfig(rollout_engine="hf", rollout_temperature=3.0))
