"""The path a user with a real instruct model takes, rehearsed offline.

A tiny Qwen2 with a byte-level BPE tokenizer and a Qwen-style chat template (``chat_model.py``)
trains through exactly the README's command line: ``--hf-checkpoint DIR --prompt-data
train.jsonl --input-key prompt --label-key answer --apply-chat-template --rm-type math
--eval-prompt-data gsm test.jsonl --eval-interval ...``, for a few rollouts, with evaluation.
"""

import json

import pytest

from vime_shell.megatron.spawn import spawn

pytestmark = pytest.mark.slow


def _cli_worker(rank: int, argv: list[str]) -> int:
    from vime_shell.cli.main import main

    return main(argv)


def test_instruct_model_with_dataset_chat_template_math_reward_and_eval(tmp_path):
    from tests.shell.chat_model import build_chat_model

    model = build_chat_model(tmp_path / "qwen-tiny")
    rows = [{"prompt": f"What is {a} + {b}? Put the final answer in \\boxed{{}}.",
             "answer": str(a + b)} for a in range(6) for b in range(4)]
    for name, part in (("train", rows[:16]), ("test", rows[16:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    run = tmp_path / "run"
    argv = ["train", "--hf-checkpoint", str(model), "--prompt-data", str(tmp_path / "train.jsonl"),
            "--input-key", "prompt", "--label-key", "answer", "--apply-chat-template",
            "--rm-type", "math", "--eval-prompt-data", "gsm", str(tmp_path / "test.jsonl"),
            "--eval-interval", "2", "--num-rollout", "3", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "4", "--global-batch-size", "16",
            "--rollout-max-response-len", "8", "--rollout-shuffle", "--run-dir", str(run)]
    assert spawn(_cli_worker, 1, argv) == [0]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [x for x in lines if not x.get("eval_only")]
    assert [x["rollout"] for x in trained] == [0, 1, 2]
    assert all(x["logprob_gap"] < 1e-4 and x["num_groups"] == 16 for x in trained)
    assert [x["rollout"] for x in lines if "eval/gsm/reward_mean" in x] == [0, 2, 3]
    assert (run / "curves.png").stat().st_size > 0
