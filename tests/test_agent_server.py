"""The agent session server (``vime_shell.agents``), driven by the official ``openai`` client and
by plain HTTP, in front of a scripted engine: turns that extend a conversation continue its
token path (nothing the model generated is re-tokenised), a rewritten history and a sub-agent
add leaves to the same group, the leaves count every generated token once, tool calls come back
in OpenAI's shape, and every bad request gets an OpenAI-style error body."""

import asyncio
import json

import httpx
import numpy as np
import openai
import pytest

from vime_pure.data.batch import RolloutBatch
from vime_pure.data.tool_calls import FORMATS
from vime_shell.agents.server import shared_server, subagent_url
from vime_shell.agents.sessions import Execution
from vime_shell.engines.base import Generation, SamplingParams
from vime_shell.models.chat_model import QWEN_TOOL_TEMPLATE, build_chat_model
from vime_shell.models.tokenizer import load_tokenizer
from vime_shell.rollout.generate import GenerateRuntime

CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = load_tokenizer(build_chat_model(tmp_path_factory.mktemp("chat")))
    tok.chat_template = QWEN_TOOL_TEMPLATE
    return tok


class ScriptedEngine:
    """Answers each request with the next scripted text (its tokens, then ``<|im_end|>``),
    and keeps every prompt it was given."""

    name = "scripted"
    weight_version = 3
    in_flight = 0

    def __init__(self, tokenizer, replies: list[str], *, end: bool = True):
        self.tok, self.replies, self.end = tokenizer, list(replies), end
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids, params: SamplingParams) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids = self.tok(self.replies.pop(0), add_special_tokens=False)["input_ids"]
        ids = ids[:params.max_new_tokens - 1]
        if self.end:
            ids.append(self.tok.convert_tokens_to_ids("<|im_end|>"))
        return Generation(token_ids=ids, log_probs=[-0.25] * len(ids),
                          finish_reason="stop" if self.end else "length",
                          weight_version=self.weight_version)

    def abort_all(self) -> int:
        return 0


def run_session(tokenizer, replies, agent, *, context_len=None, end=True):
    """``agent(base_url)`` against a fresh execution on its own loop, as the per-sample driver
    runs one; returns (what the agent returned, the execution, the engine)."""
    engine = ScriptedEngine(tokenizer, replies, end=end)

    async def main():
        execution = Execution(
            key=f"t{id(engine):x}", runtime=GenerateRuntime(engine=engine, tokenizer=tokenizer),
            loop=asyncio.get_running_loop(), tokenizer=tokenizer, fmt=FORMATS["qwen"],
            base=SamplingParams(max_new_tokens=256, seed=7), where="test prompt",
            context_len=context_len)
        server = shared_server()
        url = server.open(execution)
        try:
            return await agent(url), execution
        finally:
            server.close(execution.key)

    out, execution = asyncio.run(main())
    return out, execution, engine


def _client(url):
    return openai.AsyncOpenAI(base_url=url, api_key="vime", max_retries=0)


def test_the_openai_client_drives_a_tool_call_and_its_answer_on_one_token_path(tokenizer):
    async def agent(url):
        client = _client(url)
        messages = [{"role": "user", "content": "What is a?"}]
        first = await client.chat.completions.create(model="vime", messages=messages,
                                                     tools=TOOLS)
        call = first.choices[0].message
        messages += [call.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "42"}]
        second = await client.chat.completions.create(model="vime", messages=messages)
        return first, second

    (first, second), execution, engine = run_session(tokenizer, [CALL, "42"], agent)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "lookup"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"key": "a"}
    assert second.choices[0].message.content == "42"
    assert second.usage.prompt_tokens == len(engine.prompts[1])
    # turn 2 continues turn 1's tokens exactly: its prompt and the model's output, then "\n"
    # and the tool turn rendered alone
    turn1 = engine.prompts[0] + tokenizer(CALL, add_special_tokens=False)["input_ids"] + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert engine.prompts[1][:len(turn1)] == turn1
    leaves = execution.samples(group_id=5)
    assert len(leaves) == 1  # one path: one sample
    leaf = leaves[0]
    generated = sum(len(r) + 1 for r in (tokenizer(CALL, add_special_tokens=False)["input_ids"],
                                         tokenizer("42", add_special_tokens=False)["input_ids"]))
    assert sum(leaf.loss_mask) == generated
    assert leaf.weight_versions == [3, 3] and leaf.group_id == 5


def test_compaction_and_a_sub_agent_add_leaves_to_the_group_counting_each_token_once(
        tokenizer):
    async def agent(url):
        client = _client(url)
        history = [{"role": "user", "content": "task"}]
        r = await client.chat.completions.create(model="vime", messages=history)
        history.append(r.choices[0].message.model_dump(exclude_none=True))
        history.append({"role": "user", "content": "go on"})
        await client.chat.completions.create(model="vime", messages=history)
        summary = [{"role": "user", "content": "summary: step 1 done"}]  # compaction
        await client.chat.completions.create(model="vime", messages=summary)
        sub = _client(subagent_url(url, "helper"))
        await sub.chat.completions.create(model="vime",
                                          messages=[{"role": "user", "content": "sub task"}])

    replies = ["step 1", "step 2", "step 3", "sub answer"]
    _, execution, _ = run_session(tokenizer, replies, agent)
    leaves = execution.samples(group_id=0)
    assert len(leaves) == 3  # the extended path, the compacted branch, the sub-agent
    generated = sum(len(tokenizer(r, add_special_tokens=False)["input_ids"]) + 1
                    for r in replies)
    assert sum(sum(s.loss_mask) for s in leaves) == generated
    for leaf in leaves:
        leaf.reward = 1.0  # the execution's one reward (the driver's rewarder sets it)
    batch = RolloutBatch.from_samples([leaves])
    assert batch.num_groups == 1  # one execution: one group, its denominator every token
    np.testing.assert_array_equal(batch.group_mask_sums, [generated] * 3)


def test_a_reply_cut_by_the_length_limit_is_closed_before_the_next_turn(tokenizer):
    async def agent(url):
        client = _client(url)
        messages = [{"role": "user", "content": "q"}]
        r = await client.chat.completions.create(model="vime", messages=messages)
        assert r.choices[0].finish_reason == "length"
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "more"}]
        await client.chat.completions.create(model="vime", messages=messages)

    _, execution, engine = run_session(tokenizer, ["abc", "d"], agent, end=False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    first = engine.prompts[0] + tokenizer("abc", add_special_tokens=False)["input_ids"]
    assert engine.prompts[1][:len(first) + 1] == first + [end]  # the turn end the model lacked
    assert len(execution.samples(group_id=0)) == 1


def test_a_template_that_is_not_append_only_renders_the_conversation_whole(tokenizer):
    """A template that joins turns with '#' and prompts with '=' renders a finished turn
    unlike the prompt the model answered: the next request is rendered whole (a branch, its
    own leaf), never the old tokens with a misaligned suffix."""
    joined = ("{% for m in messages %}{{ m['content'] }}{% if not loop.last %}#{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}={% endif %}")
    original, tokenizer.chat_template = tokenizer.chat_template, joined
    try:
        async def agent(url):
            client = _client(url)
            messages = [{"role": "user", "content": "1"}]
            r = await client.chat.completions.create(model="vime", messages=messages)
            messages += [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "2"}]
            await client.chat.completions.create(model="vime", messages=messages)

        _, execution, engine = run_session(tokenizer, ["3", "4"], agent)
    finally:
        tokenizer.chat_template = original
    assert engine.prompts[1] == tokenizer("1#3#2=", add_special_tokens=False)["input_ids"]
    assert len(execution.samples(group_id=0)) == 2


def test_a_tool_call_that_does_not_parse_comes_back_as_text_with_a_flag(tokenizer):
    broken = '<tool_call>\n{"name": lookup}\n</tool_call>'

    async def agent(url):
        async with httpx.AsyncClient() as http:
            r = await http.post(f"{url}/chat/completions", json={
                "model": "vime", "messages": [{"role": "user", "content": "q"}]})
            return r.status_code, r.json()

    (status, body), _, _ = run_session(tokenizer, [broken], agent)
    choice = body["choices"][0]
    assert status == 200 and choice["message"]["content"] == broken
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
    assert "does not parse" in choice["tool_call_parse_error"]


@pytest.mark.parametrize("payload, status, code, param", [
    (b"{not json", 400, "invalid_json", None),
    ({"messages": []}, 400, "invalid_request", "messages"),
    ({"messages": [{"role": "robot", "content": "q"}]}, 400, "invalid_request", "messages[0]"),
    ({"messages": [{"role": "user", "content": "q"}], "n": 2}, 400, "invalid_request", "n"),
    ({"messages": [{"role": "user", "content": "q"}], "stream": True}, 400, "invalid_request",
     "stream"),
    ({"messages": [{"role": "user", "content": "q"}], "max_tokens": 0}, 400,
     "invalid_request", "max_tokens"),
    ({"messages": [{"role": "user", "content": "q " * 40}]}, 400, "context_length_exceeded",
     "messages"),
])
def test_a_bad_request_gets_an_openai_error_body_never_a_traceback(tokenizer, payload, status,
                                                                    code, param):
    async def agent(url):
        async with httpx.AsyncClient() as http:
            r = await http.post(f"{url}/chat/completions",
                                **({"content": payload} if isinstance(payload, bytes)
                                   else {"json": payload}))
            return r.status_code, r.json()

    (got, body), execution, engine = run_session(tokenizer, ["x"], agent, context_len=32)
    assert got == status and body["error"]["code"] == code and body["error"]["param"] == param
    assert "Traceback" not in body["error"]["message"]
    assert engine.prompts == [] and execution.samples(group_id=0) == []


def test_an_unknown_or_ended_session_is_404_and_sessions_do_not_leak(tokenizer):
    async def agent(url):
        async with httpx.AsyncClient() as http:
            other = url.replace("/sessions/", "/sessions/nosuch")
            r = await http.post(f"{other}/chat/completions",
                                json={"messages": [{"role": "user", "content": "q"}]})
            return url, r.status_code, r.json()

    (url, status, body), _, _ = run_session(tokenizer, ["x"], agent)
    assert status == 404 and body["error"]["code"] == "not_found"
    ended = httpx.post(f"{url}/chat/completions",
                       json={"messages": [{"role": "user", "content": "q"}]})
    assert ended.status_code == 404  # the execution ended: its session is gone


@pytest.fixture(scope="module")
def agent_tokenizer(tmp_path_factory):
    from vime_shell.models.chat_model import build_agent_chat_model

    return load_tokenizer(build_agent_chat_model(tmp_path_factory.mktemp("agent") / "m"))


@pytest.mark.parametrize("replies, leaves, reward", [
    (["?", "{v}", "{v}"], 3, 1.0),   # looks up, the reader and the answer copy the value
    (["?", "9", "{v}"], 3, 0.7),     # the reader writes another digit: 0.2 + 0.1 + 0.4
    (["3"], 1, 0.0),                 # answers without the lookup: it cannot know the value
])
def test_the_example_agent_needs_its_tool_and_fans_out(agent_tokenizer, replies, leaves,
                                                       reward):
    from vime_shell.agents.lookup_example import VALUES, run_agent

    seed = 11
    value = str(__import__("random").Random(seed).randrange(VALUES))

    async def agent(url):
        return await run_agent(url, "find", {"max_tokens": 2}, {"execution_seed": seed})

    script = [r.format(v=value) for r in replies]
    out, execution, _ = run_session(agent_tokenizer, script, agent)
    assert out["reward"] == pytest.approx(reward)
    assert len(execution.samples(group_id=0)) == leaves


def test_an_execution_closes_the_clients_it_made(agent_tokenizer):
    """``openai_client`` clients close with their execution, so a long run keeps no socket of
    a finished one (a run of 300 rollouts ran out of file descriptors before)."""
    from types import SimpleNamespace

    from vime_pure.data.sample import Sample
    from vime_shell.agents import agent as agents
    from vime_shell.rollout.generate import sampling_params_dict, use_runtime

    made = []

    async def run(base_url, prompt, request_kwargs, metadata, **kwargs):
        made.append(agents.openai_client(base_url))
        await made[-1].chat.completions.create(model="vime", messages=[
            {"role": "user", "content": prompt}], **request_kwargs)
        return {"reward": 1.0}

    agents._AGENTS["tests:closing"] = run
    args = SimpleNamespace(custom_agent_function_path="tests:closing", tito_model="qwen",
                           session_message_matcher="strict")
    engine = ScriptedEngine(agent_tokenizer, ["3"])

    async def main():
        with use_runtime(GenerateRuntime(engine=engine, tokenizer=agent_tokenizer)):
            return await agents.generate(args, Sample(metadata={"prompt": "find"}),
                                         sampling_params_dict(SamplingParams(max_new_tokens=2)))

    out = asyncio.run(main())
    assert made[0].is_closed() and out.reward == 1.0 and out.metadata["prompt"] == "find"


@pytest.mark.filterwarnings("ignore:coroutine 'Execution.complete' was never awaited")
def test_a_turn_whose_execution_never_answers_is_a_504_within_its_bound(tokenizer):
    """The server's wait for a turn is bounded (the execution's loop has ended, or is stuck):
    an OpenAI-style 504, never a request left hanging."""
    stuck = asyncio.new_event_loop()  # never run: nothing it is handed ever finishes
    engine = ScriptedEngine(tokenizer, ["x"])
    execution = Execution(key="stuck", runtime=GenerateRuntime(engine=engine,
                                                               tokenizer=tokenizer),
                          loop=stuck, tokenizer=tokenizer, fmt=FORMATS["qwen"],
                          base=SamplingParams(max_new_tokens=4), where="test",
                          turn_timeout=0.3)
    server = shared_server()
    url = server.open(execution)
    try:
        r = httpx.post(f"{url}/chat/completions",
                       json={"messages": [{"role": "user", "content": "q"}]}, timeout=30)
    finally:
        server.close("stuck")
        stuck.close()
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"


def test_a_session_that_outlives_a_weight_sync_continues_on_the_new_weights(tmp_path):
    """The fully-async pool loads weights between two forwards of the engine's front, so a
    session can outlive a sync. Its next turn extends the same token path and is generated by
    the new weights: its tokens and log-probs are what a fresh engine holding those weights
    gives for that prompt, and the leaf records one version per turn (0, then 1), which the
    batch reads as the sample's version span (staleness is counted from its oldest token)."""
    from vime_shell.engines.async_engine import async_front
    from vime_shell.engines.hf import HfEngine

    path = build_chat_model(tmp_path / "chat")
    tok = load_tokenizer(path)
    tok.chat_template = QWEN_TOOL_TEMPLATE
    engine = HfEngine(path, tokenizer=tok)
    front = async_front(engine, decode=tok.decode)
    # the synced weights: every parameter moved (a trainer step's worth, made large)
    new = [(n, p.detach() * 1.5 + 0.01) for n, p in engine.model.named_parameters()]

    async def main():
        execution = Execution(
            key="sync", runtime=GenerateRuntime(engine=front, tokenizer=tok),
            loop=asyncio.get_running_loop(), tokenizer=tok, fmt=FORMATS["qwen"],
            base=SamplingParams(max_new_tokens=6, seed=11, temperature=1.0),
            where="test prompt")
        server = shared_server()
        client = _client(server.open(execution))
        try:
            messages = [{"role": "user", "content": "task"}]
            first = await client.chat.completions.create(model="vime", messages=messages)
            engine.update_weights_from_tensors(new)  # the sync, between two turns
            engine.weight_version = 1
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "go on"}]
            await client.chat.completions.create(model="vime", messages=messages)
        finally:
            server.close(execution.key)
        return execution

    execution = asyncio.run(main())
    turns = execution.sessions[""].tree.turns
    assert [t.weight_version for t in turns] == [0, 1]
    assert turns[1].prompt[:len(turns[0].prompt) + len(turns[0].output)] == (
        turns[0].prompt + turns[0].output)  # the same token path, continued
    (leaf,) = execution.samples(group_id=0)
    assert leaf.weight_versions == [0, 1]
    generated = [v for v, m in zip(leaf.token_versions, leaf.loss_mask) if m]
    assert generated == [0] * len(turns[0].output) + [1] * len(turns[1].output)
    assert {v for v, m in zip(leaf.token_versions, leaf.loss_mask) if not m} == {-1}
    leaf.reward = 1.0
    batch = RolloutBatch.from_samples([[leaf]])
    assert (batch.weight_version_min[0], batch.weight_version_max[0]) == (0, 1)

    fresh = HfEngine(path, tokenizer=tok)  # what the new weights alone give for turn 2
    fresh.update_weights_from_tensors(new)
    execution.turns = 1  # turn 2's sampling (its seed is the execution's turn count then)
    again = asyncio.run(async_front(fresh, decode=tok.decode).generate(
        list(turns[1].prompt), execution._params({}, turns[1].prompt)))
    assert tuple(again.token_ids) == turns[1].output
    np.testing.assert_allclose(again.log_probs, turns[1].log_probs, atol=1e-5)
