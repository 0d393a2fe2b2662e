"""``vime train`` with per-sample generation, end to end on the embedded model (one process).

- The multi-turn tool example (``vime_shell.rollout.tool_example``) trains: the engine-trainer
  gap stays below 1e-4 with tool output in the responses, and exactly the tool's output tokens
  have loss mask 0 (one rollout group per execution: one sample each);
- ``--partial-rollout --mask-offpolicy-in-partial-rollout`` with a long-tailed ``generate``:
  unfinished groups come back in the next rollout, samples span two weight versions, their
  tokens from older weights have mask 0 (counted as ``partial/offpolicy_token_frac``), and the
  group denominators are the sums of the masks;
- a ``--partial-rollout`` checkpoint resumed without ``--partial-rollout`` generates its
  buffered groups again from scratch: every drawn prompt trains exactly once across the two
  runs (under ``--fully-async`` that resume is refused at launch, naming the count).
"""

import re
from collections import Counter

import pytest

from tests.shell.agentic_workers import agentic_worker
from vime_shell.megatron.spawn import spawn
from vime_shell.models.tokenizer import load_tokenizer
from vime_shell.rollout.tasks import arithmetic_rows
from vime_shell.rollout.tool_example import TOOL_CALL, reverse_tool

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("agentic")
    cache = str(tmp_path_factory.mktemp("embedded"))
    return spawn(agentic_worker, 1, str(root), cache)[0] | {"cache": cache}


def test_the_tool_example_trains_with_tool_tokens_masked(runs):
    from vime_shell.models.embedded import build_embedded

    tok = load_tokenizer(build_embedded(runs["cache"]))
    calls = 0
    for r in runs["tool"]:
        assert r["metrics"]["logprob_gap"] < 1e-4
        for prompt, response, mask in r["samples"]:
            text = tok.decode(response, skip_special_tokens=True)
            tool = reverse_tool(tok.decode(prompt))
            if text.startswith(TOOL_CALL + tool) or text[1:].startswith(TOOL_CALL + tool):
                calls += 1
                at = text.index(TOOL_CALL + tool) + 1
                assert mask == [1] * at + [0] * len(tool) + [1] * (len(mask) - at - len(tool))
            else:
                assert mask == [1] * len(mask)
    assert calls > 0, "an untrained model calls the tool now and then (1 token in ~20)"


def test_a_partial_rollout_resumes_groups_and_masks_older_tokens(runs):
    records = [r["metrics"] for r in runs["partial"]]
    assert all(r["prompts_kept"] == 4 for r in records)
    assert records[0]["partial/resumed_groups"] == 0
    assert all(r["partial/resumed_groups"] > 0 for r in records[1:])
    spanning = 0
    for r in runs["partial"][1:]:
        lo, hi = r["versions"]
        for (prompt, response, mask), a, b in zip(r["samples"], lo, hi):
            if a < b:  # resumed under newer weights: its first tokens are masked
                spanning += 1
                assert mask[0] == 0 and mask[-1] == 1
        masked = sum(len(m) - sum(m) for _, _, m in r["samples"])
        tokens = sum(len(m) for _, _, m in r["samples"])
        assert masked == round(r["metrics"]["partial/offpolicy_token_frac"] * tokens)
    assert spanning > 0
    last = runs["partial"][-1]
    groups = last["group_mask_sums"]
    assert groups == [sum(m) for _, _, m in last["samples"]]  # one sample per group


def test_resume_without_partial_rollout_regenerates_the_buffered_groups(runs):
    """Rollouts 0-1 with --partial-rollout draw 6 + 4 prompts and train 8; the checkpoint
    holds the other 2, unfinished. Rollout 2, resumed without the flag, trains those 2 first
    plus 2 new prompts: the first 12 prompts of the dataset, each exactly once (4 samples)."""
    from vime_shell.models.embedded import build_embedded

    tok = load_tokenizer(build_embedded(runs["cache"]))
    first, rest = runs["put_back_first"], runs["put_back_rest"]
    assert runs["put_back_waiting"] == 2
    assert [r["metrics"]["rollout"] for r in first + rest] == [0, 1, 2]
    rows = [row["prompt"] for row in arithmetic_rows()[0]]

    def prompts(records):
        return Counter(re.search(r"\d\+\d", tok.decode(p)).group()
                       for r in records for p in r["prompts"])

    assert prompts(first + rest) == {row: 4 for row in rows[:12]}  # 4 samples per prompt
    assert set(prompts(rest)) - set(rows[10:12]) == set(rows[:10]) - set(prompts(first))


def test_resume_of_a_partial_checkpoint_under_fully_async_is_refused_with_the_count(runs):
    kind, message = runs["put_back_async"]
    assert kind == "CheckpointError"
    assert message.startswith("--fully-async=True: cannot resume ")
    assert "holds 2 prompt groups left unfinished by --partial-rollout" in message
    assert message.count("Fix:") == 1
