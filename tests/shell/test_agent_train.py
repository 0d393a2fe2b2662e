"""``vime train --custom-agent-function-path`` end to end on 2 ranks, in each mode: an agent that
talks to the session server with the ``openai`` client and fans out (a second turn on its path,
a compacted history, a sub-agent) trains as one group of 3 samples per execution, whose loss
denominator is the group's whole mask total (every generated token once); colocated, the
evaluation runs the agent through the server too."""

import pytest

from tests.shell.agent_workers import MODES, agent_worker
from vime_shell.megatron.spawn import spawn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from vime_shell.models.chat_model import QWEN_TOOL_TEMPLATE, build_chat_model
    from vime_shell.models.tokenizer import load_tokenizer

    path = build_chat_model(tmp_path_factory.mktemp("chat") / "qwen")
    tok = load_tokenizer(path)
    tok.chat_template = QWEN_TOOL_TEMPLATE
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("mode", list(MODES))
def test_an_agent_trains_its_fan_out_as_one_group_in_every_mode(tmp_path, model, mode):
    out = spawn(agent_worker, 2, str(tmp_path), model, mode)
    rollouts = out[0]["rollouts"]
    assert len(rollouts) == 2
    for r in rollouts:
        assert r["sizes"] == [3] * 16  # 4 prompts x 4 executions, 3 leaves each
        assert r["group_mask_sums"] == r["mask_totals"]  # the group's whole total, each leaf
        assert r["loss"] == r["loss"]  # trained (finite)
        assert r["fan_out"] == 3  # the record's fan-out
        assert r["tool_calls"] == 2.0  # per execution, counted once over its 3 leaves
    if mode == "colocated":  # evaluated through the session server as well
        assert all(r["eval"] is not None for r in rollouts)
