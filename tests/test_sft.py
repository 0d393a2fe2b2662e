"""Supervised fine-tuning (``--loss-type sft_loss`` with ``vime_shell.rollout.sft:sft_rollout``,
slime's ``slime.rollout.sft_rollout.generate_rollout``).

Asserted: a conversation's tokens are its turns' tokens in order, with loss mask 1 exactly on
what the assistant turns add after the template's generation prompt (Hypothesis over
conversations, on the embedded template and a Qwen-style one with role headers);
``--loss-mask-type qwen3_5`` marks the assistant texts of one rendering where the template
drops earlier reasoning, and ``distill_qwen`` the last message after the first; rows that are
not conversations, that have no assistant turn, or whose template rewrites earlier turns (under
the turn-by-turn types) are typed errors; the SFT terms are each token's negative log-likelihood, so a step's loss is the
loss mode's mean of it and any split into rows gives the same loss and gradient; the flags
(slime's path maps to vime's, ``--n-samples-per-prompt`` defaults to 1 there, the policy knobs
and ``--disable-compute-advantages-and-returns`` are checked against the loss type, slime's
``custom_loss`` prints its table line); and the embedded model learns a conversation set
(negative log-likelihood falls) through ``vime train``.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.loss_helpers import Step, step_denominators
from tests.qwen_tokenizer import qwen35_tokenizer
from vime_pure import LossMode
from vime_pure.torch_ops.loss import microbatch_loss
from vime_pure.torch_ops.policy_loss import sft_terms
from vime_shell.models.embedded import build_embedded
from vime_shell.models.tokenizer import load_tokenizer
from vime_shell.rollout.functions import SFT_ROLLOUT_FUNCTION
from vime_shell.rollout.sft import conversation_tokens, sft_sample
from vime_shell.rollout.tasks import TaskError, TaskExample
from vime_shell.settings.common import ConfigError
from vime_shell.settings.flags import parse_train_config
from vime_shell.settings.train_config import TrainConfig

SRC = str(Path(__file__).resolve().parents[1] / "src")
# Role headers and an end-of-turn mark, within the embedded alphabet ('a' user, 'b' assistant)
HEADED = ("{% for m in messages %}{{ 'a' if m['role'] == 'user' else 'b' }}>{{ m['content'] }}"
          "#{% endfor %}{% if add_generation_prompt %}b>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(build_embedded(tmp_path_factory.mktemp("embedded")))


@pytest.fixture(scope="module")
def headed(tokenizer):
    import copy

    other = copy.deepcopy(tokenizer)
    other.chat_template = HEADED
    return other


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_docstring_example(tokenizer):
    messages = [{"role": "user", "content": "12>"}, {"role": "assistant", "content": "21"}]
    tokens, mask = conversation_tokens(tokenizer, messages)
    assert tokens == _ids(tokenizer, "12>#21") and mask == [0, 0, 0, 1, 1, 1]
    sample = sft_sample(tokenizer, TaskExample(prompt=messages), group_id=4, index=4)
    assert (sample.response_length, sample.loss_mask, sample.reward) == (3, [1, 1, 1], 0.0)
    assert sample.tokens == tokens and sample.group_id == 4


def test_role_headers_are_not_trained(headed):
    messages = [{"role": "user", "content": "12"}, {"role": "assistant", "content": "21"},
                {"role": "user", "content": "3"}, {"role": "assistant", "content": "4"}]
    tokens, mask = conversation_tokens(headed, messages)
    assert tokens == _ids(headed, "a>12#b>21#a>3#b>4#")
    # a>12#  b>  21#  a>3#  b>  4#
    assert mask == [0] * 5 + [0, 0] + [1, 1, 1] + [0] * 4 + [0, 0] + [1, 1]


@given(st.lists(st.tuples(st.sampled_from(["user", "assistant", "system"]),
                          st.text("0123456789+=", min_size=1, max_size=4)),
                min_size=1, max_size=6))
def test_the_mask_marks_exactly_the_assistant_contents(headed, turns):
    """Any conversation: the tokens are the whole rendering, and the trained tokens read back
    as the assistant contents, each followed by its end-of-turn mark, in order."""
    messages = [{"role": r, "content": c} for r, c in turns]
    if not any(r == "assistant" for r, _ in turns):
        with pytest.raises(TaskError, match="no assistant turn"):
            conversation_tokens(headed, messages)
        return
    tokens, mask = conversation_tokens(headed, messages)
    assert tokens == _ids(headed, headed.apply_chat_template(messages, tokenize=False))
    trained = headed.decode([t for t, m in zip(tokens, mask) if m])
    assert trained == "".join(c + "#" for r, c in turns if r == "assistant")


def test_bad_rows_are_typed_errors(tokenizer, headed):
    with pytest.raises(TaskError, match="is not a conversation"):
        conversation_tokens(tokenizer, "12>")
    with pytest.raises(TaskError, match="no assistant turn"):
        conversation_tokens(tokenizer, [{"role": "user", "content": "1"}])
    import copy

    rewriting = copy.deepcopy(tokenizer)  # drops every turn but the last two
    rewriting.chat_template = ("{% for m in messages[-2:] %}{{ m['content'] }}#{% endfor %}")
    messages = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"},
                {"role": "user", "content": "3"}]
    with pytest.raises(TaskError, match=r"renders turn 2 \(user\) by rewriting the turns"):
        conversation_tokens(rewriting, messages)


@pytest.fixture(scope="module")
def qwen35():
    return qwen35_tokenizer()


def _trained(tokenizer, tokens, mask) -> str:
    return "".join(tokenizer.convert_ids_to_tokens([t for t, m in zip(tokens, mask) if m]))


def test_qwen3_5_masks_each_assistant_text_of_one_rendering(qwen35):
    """--loss-mask-type qwen3_5: the template drops earlier reasoning, which the turn-by-turn
    method refuses; one rendering's assistant texts are trained (the last turn's reasoning
    too, its <think> line not), with <|im_end|> and its newline; a turn with step_loss_mask
    0 is not."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "<think>\nr1</think>\nA1"},
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "<think>\nr2</think>\nA2"}]
    with pytest.raises(TaskError, match="rewriting the turns"):
        conversation_tokens(qwen35, messages, mask_type="qwen")
    tokens, mask = conversation_tokens(qwen35, messages, mask_type="qwen3_5")
    assert tokens == _ids(qwen35, qwen35.apply_chat_template(messages, tokenize=False))
    assert _trained(qwen35, tokens, mask) == "A1<|im_end|>\nr2</think>\nA2<|im_end|>\n"
    skipped = [*messages[:3], {**messages[3], "step_loss_mask": 0}]
    assert _trained(qwen35, *conversation_tokens(qwen35, skipped, mask_type="qwen3_5")) == \
        "A1<|im_end|>\n"
    tokens, mask = conversation_tokens(qwen35, messages, mask_type="distill_qwen")
    assert _trained(qwen35, tokens, mask) == "<think>\nr2</think>\nA2"
    assert "".join(qwen35.convert_ids_to_tokens(tokens[:mask.index(1)])) == \
        qwen35.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)


def test_qwen3_5_needs_the_qwen_markers(headed):
    messages = [{"role": "user", "content": "12"}, {"role": "assistant", "content": "21"}]
    with pytest.raises(TaskError, match="without Qwen's"):
        conversation_tokens(headed, messages, mask_type="qwen3_5")


@given(st.lists(st.integers(1, 6), min_size=1, max_size=5), st.sampled_from(list(LossMode)),
       st.data())
def test_sft_terms_are_the_negative_log_likelihood_under_any_split(lengths, mode, data):
    masks = [data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n))
             for n in lengths]
    step = Step(list(range(len(lengths))), [1] * len(lengths), masks)
    dens = torch.as_tensor(step_denominators(step, mode, "original"), dtype=torch.float64)
    mask = torch.tensor([m for ms in masks for m in ms], dtype=torch.float64)
    index = torch.tensor([k for k, n in enumerate(lengths) for _ in range(n)])
    logp = torch.linspace(-3.0, -0.1, sum(lengths), dtype=torch.float64, requires_grad=True)
    terms = sft_terms(logp)
    assert torch.equal(terms.total, -logp) and not terms.clipped.any()
    whole = microbatch_loss(terms.total, mask, index, dens)
    split = sum(microbatch_loss(terms.total[index == k], mask[index == k],
                                torch.zeros(int((index == k).sum()), dtype=torch.long),
                                dens[k:k + 1]) for k in range(len(lengths)))
    assert float(split) == pytest.approx(float(whole), rel=1e-12, abs=1e-12)
    whole.backward()
    expected = torch.tensor([-m / float(dens[k]) if dens[k] else 0.0
                             for k, ms in enumerate(masks) for m in ms], dtype=torch.float64)
    if mode is LossMode.TOKEN_MEAN or mode is LossMode.GROUP_TOKEN_MEAN:
        torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=1e-12)


def test_flags():
    cfg = parse_train_config(["--rollout-function-path",
                              "slime.rollout.sft_rollout.generate_rollout",
                              "--loss-type", "sft_loss", "--prompt-data", "x.jsonl",
                              "--global-batch-size", "16"])
    assert cfg.rollout_function_path == SFT_ROLLOUT_FUNCTION
    assert cfg.n_samples_per_prompt == 1 and cfg.loss_config().loss_type == "sft_loss"
    assert not cfg.effective_logprob_check and cfg.max_response_len == 1
    with pytest.raises(ConfigError, match="n_samples_per_prompt=8: would repeat each conv"):
        TrainConfig(rollout_function_path=SFT_ROLLOUT_FUNCTION, loss_type="sft_loss")
    with pytest.raises(ConfigError, match="--loss-type='policy_loss': trains the policy gradient"):
        TrainConfig(rollout_function_path=SFT_ROLLOUT_FUNCTION, n_samples_per_prompt=1)
    with pytest.raises(ConfigError, match="--use-tis=True: acts on the policy loss"):
        TrainConfig(loss_type="sft_loss", use_tis=True)
    with pytest.raises(ConfigError, match="--disable-compute-advantages-and-returns=True"):
        TrainConfig(disable_compute_advantages_and_returns=True)
    TrainConfig(loss_type="sft_loss", disable_compute_advantages_and_returns=True)
    # --debug-train-only: no engine, on dumps or on conversations (slime's SFT scripts)
    with pytest.raises(ConfigError, match="--debug-train-only=True: trains without an engine"):
        TrainConfig(debug_train_only=True)
    TrainConfig(debug_train_only=True, rollout_function_path=SFT_ROLLOUT_FUNCTION,
                loss_type="sft_loss", n_samples_per_prompt=1, global_batch_size=16)
    done = subprocess.run([sys.executable, "-m", "vime_shell.cli", "train", "--loss-type",
                           "custom_loss"], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": SRC, "PATH": ""})
    assert done.returncode == 2
    assert "--loss-type custom_loss: not supported in vime (a loss plugin" in done.stderr


@pytest.mark.slow
def test_the_embedded_model_learns_conversations(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"{a}{b}>"},
                          {"role": "assistant", "content": f"{b}{a}"}]}
            for a in range(8) for b in range(8)]
    data = tmp_path / "conv.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "vime_shell.cli", "train", "--run-dir", str(run),
         "--prompt-data", str(data), "--input-key", "messages",
         "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
         "--loss-type", "sft_loss", "--disable-compute-advantages-and-returns",
         "--debug-train-only", "--save-hf", str(tmp_path / "hf"),
         "--rollout-batch-size", "16", "--global-batch-size", "16", "--num-rollout", "12",
         "--lr", "3e-3"],
        capture_output=True, text=True, timeout=600,
        env={"PYTHONPATH": SRC, "PATH": "", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path),
             "VIME_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    # each rollout's loss is the mean NLL of its 3 trained tokens per conversation
    assert losses[0] > 2.5 and sum(losses[-3:]) / 3 < 0.6 * losses[0], losses
    assert records[-1]["logprob_check"] == 0
    assert "startup: no engine" in done.stderr  # nothing built to generate, nothing synced
    # the export is the trained model: its NLL of the assistant tokens is the trained one's
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    nll = []
    for row in rows[:16]:
        tokens, mask = conversation_tokens(tokenizer, row["messages"])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
        nll += (-logp[torch.tensor(mask[1:]) > 0]).tolist()
    assert sum(nll) / len(nll) < 0.6 * losses[0]
