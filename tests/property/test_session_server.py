"""The session server's request handling (``vime_shell.agents.sessions.Execution``) as
Hypothesis properties over random agent conversations, each request one of: **extend** the
last conversation (its reply kept, a user message appended), **rewrite** it (compaction: a
fresh history), **retry** an earlier request (the same messages again), or a **sub-agent**'s
turn. For every conversation:

- the leaves cover every generated token exactly once: the runs of mask 1 over all leaves are
  exactly the turns' outputs, each once, and the masks total the generated tokens;
- mask 1 marks only generated tokens (a run is a turn's output, never context);
- a request whose messages extend a stored context continues its tokens (its prompt begins
  with that context's prompt and output: nothing generated is re-tokenised), and a retry's
  prompt is the retried request's own, so its branch starts where the replies diverge.
"""

import asyncio
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.test_agent_server import ScriptedEngine
from vime_pure.data.tool_calls import FORMATS
from vime_shell.agents.sessions import Execution
from vime_shell.engines.base import SamplingParams
from vime_shell.models.chat_model import QWEN_TOOL_TEMPLATE, build_chat_model
from vime_shell.models.tokenizer import load_tokenizer
from vime_shell.rollout.generate import GenerateRuntime

REPLIES = st.text(alphabet="abcdxyz", min_size=1, max_size=5)
STEPS = st.lists(st.tuples(st.sampled_from(["extend", "rewrite", "retry", "sub"]), REPLIES,
                           st.integers(0, 20)), min_size=1, max_size=8)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = load_tokenizer(build_chat_model(tmp_path_factory.mktemp("chat")))
    tok.chat_template = QWEN_TOOL_TEMPLATE
    return tok


def _runs(mask: list[int], response: list[int]) -> list[tuple[int, ...]]:
    """The maximal runs of mask-1 tokens of a response."""
    runs, run = [], []
    for m, t in zip(mask, response):
        if m:
            run.append(t)
        elif run:
            runs.append(tuple(run))
            run = []
    return runs + ([tuple(run)] if run else [])


@given(steps=STEPS)
def test_leaves_cover_each_generated_token_once_and_extensions_keep_their_tokens(
        tokenizer, steps):
    engine = ScriptedEngine(tokenizer, [reply for _, reply, _ in steps])

    async def main():
        execution = Execution(
            key="prop", runtime=GenerateRuntime(engine=engine, tokenizer=tokenizer),
            loop=asyncio.get_running_loop(), tokenizer=tokenizer, fmt=FORMATS["qwen"],
            base=SamplingParams(max_new_tokens=64, seed=1), where="property")
        asked: list[tuple[str, list[dict], dict]] = []  # (session, messages, reply)
        last: dict[str, list[dict]] = {}  # each session's conversation with its last reply
        for i, (action, _, pick) in enumerate(steps):
            name = "helper" if action == "sub" else ""
            if action == "extend" and name in last:
                messages = [*last[name], {"role": "user", "content": f"then {i}"}]
            elif action == "retry" and asked:
                name, messages, _ = asked[pick % len(asked)]
            else:
                messages = [{"role": "user", "content": f"task {i}"}]
            out = await execution.complete(name, {"messages": [dict(m) for m in messages]})
            reply = out["choices"][0]["message"]
            asked.append((name, messages, reply))
            last[name] = [*messages, reply]
        return execution, asked

    execution, asked = asyncio.run(main())
    turns = [t for s in execution.sessions.values() for t in s.tree.turns]
    by_session = [(n, t) for n, s in execution.sessions.items() for t in s.tree.turns]
    leaves = execution.samples(group_id=0)
    # every generated token once, mask 1 only on generated tokens
    runs = Counter(r for leaf in leaves
                   for r in _runs(leaf.loss_mask, leaf.tokens[-leaf.response_length:]))
    assert runs == Counter(t.output for t in turns)
    assert sum(sum(leaf.loss_mask) for leaf in leaves) == sum(len(t.output) for t in turns)
    # extensions continue their context's tokens; a retry repeats the retried prompt
    order = {name: [t for n, t in by_session if n == name] for name in execution.sessions}
    seen: dict[str, int] = Counter()
    done: list[tuple[str, list[dict], object]] = []  # (session, its context's messages, turn)
    for name, messages, reply in asked:
        turn = order[name][seen[name]]
        seen[name] += 1
        for prev_name, context, prev in done:
            if prev_name != name:
                continue
            if context[:-1] == messages:  # a retry: the same prompt, a branch after it
                assert turn.prompt == prev.prompt
            if len(messages) > len(context) and messages[:len(context)] == context:
                tokens = prev.prompt + prev.output  # extended: its tokens, never re-tokenised
                assert turn.prompt[:len(tokens)] == tokens
        done.append((name, [*messages, reply], turn))
