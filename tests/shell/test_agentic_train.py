"""``vime train`` with per-sample generation, end to end on the embedded model (one process).

- The multi-turn tool example (``vime_shell.rollout.tool_example``) trains: the engine-trainer
  gap stays below 1e-4 with tool output in the responses, and exactly the tool's output tokens
  have loss mask 0 (one rollout group per execution: one sample each);
- ``--partial-rollout --mask-offpolicy-in-partial-rollout`` with a long-tailed ``generate``:
  unfinished groups come back in the next rollout, samples span two weight versions, their
  tokens from older weights have mask 0 (counted as ``partial/offpolicy_token_frac``), and the
  group denominators are the sums of the masks.
"""

import pytest

from tests.shell.agentic_workers import agentic_worker
from vime_shell.megatron.spawn import spawn
from vime_shell.models.tokenizer import load_tokenizer
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
