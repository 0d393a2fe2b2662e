"""One agent execution's sessions: OpenAI chat requests in, token paths out, leaves as samples.

Data flow of one request (``Execution.complete``, on the loop of the execution that owns the
session, the loop where the engine's per-request front lives)::

    messages ─▶ the stored context whose messages are the longest prefix of them (the match
                rule, ``MATCHERS``) ─▶ its tokens + only the appended messages tokenised
                (the template's suffix after that context, checked append-only) ─ or, with no
                such context (the first turn, a rewritten history), the whole conversation
                rendered with the chat template
             ─▶ engine.generate (the run's sampling, the request's own where it may set them)
             ─▶ Turn(prompt ids, output ids, log-probs, weight version) into the session's
                tree (``vime_pure.data.sessions``: a branch where the tokens diverge)
             ─▶ the reply parsed in the family's format (``vime_pure.data.tool_calls``)
             ─▶ an OpenAI chat.completion

So no token the model produced is ever re-tokenised on a path that extends it: an agent that
sends back the conversation it was given continues the same token path. That needs the
template to be append-only there (miles' ``verify_chat_template``): the prompt the model
answered must begin the rendered finished turn, and the finished conversation must begin the
next request's rendering; where either fails, the request is rendered whole (a branch). At the end,
``Execution.samples`` turns every leaf of every session of the execution (the root and its
sub-agents) into one ``Sample``, all in the execution's group: loss mask 1 exactly on the
generated tokens a leaf owns, so the group's loss denominator counts each generated token once.

Match rules (``--session-message-matcher``): ``strict`` (default): a stored message equals a
request message when role, content, name, tool-call id and tool calls (name and argument
text) are equal; ``tool_args``: the same, but tool-call arguments compare as parsed JSON, so
an agent that re-serialises arguments (other key order, spacing) still continues its path. A
request that matches no stored context is rendered whole: it starts a branch at the first
token where it differs (compaction, a retry, an edited history), which is never an error.

Example: turn 1 ``[user: "q"]`` -> ``"<tool_call>...</tool_call>"``; turn 2 sends ``[user,
assistant (the tool call, as returned), tool: "42"]``: its prompt is turn 1's tokens, then
``<|im_end|>`` if the reply was cut, what the template writes after a turn's end (Qwen's
newline) and the tool message's rendered suffix.
"""

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import attrs

from vime_pure.data.sample import Sample
from vime_pure.data.sessions import Session, Turn, add_turn, leaf_samples
from vime_pure.data.tool_calls import ChatFormat, ParsedReply, parse_reply
from vime_pure.errors import VimeError
from vime_shell.engines.base import SamplingParams
from vime_shell.rollout.functions import GENERATE_TIMEOUT_S
from vime_shell.rollout.generate import FINISH_STATUS, GenerateRuntime, segment_seed

MATCHERS = ("strict", "tool_args")
ROLES = ("system", "user", "assistant", "tool")
FINISH = {"stop": "stop", "length": "length", "abort": "length"}


class RequestError(VimeError):
    """A chat request the server answers with an OpenAI-style error body (``status``: the
    HTTP code, ``code``: OpenAI's error code, ``param``: the field)."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_request",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": "invalid_request_error",
                          "param": self.param, "code": self.code}}


def same_message(a: dict, b: dict, rule: str) -> bool:
    """Whether a stored message and a request message are the same under ``rule``."""
    return _key(a, rule) == _key(b, rule)


def _key(message: dict, rule: str) -> tuple:
    calls = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        args = fn.get("arguments")
        if rule == "tool_args" and isinstance(args, str):
            try:
                args = json.dumps(json.loads(args), sort_keys=True)
            except ValueError:
                pass
        calls.append((fn.get("name"), args))
    return (message.get("role"), message.get("content") or None, message.get("name"),
            message.get("tool_call_id"), tuple(calls))


@attrs.define
class Context:
    """A stored context: the messages it renders (the request's plus the reply) and its tokens
    (the turn's prompt and output); ``ended``: the output ends with the turn-end token."""

    messages: list[dict]
    tokens: tuple[int, ...]
    ended: bool


@attrs.define(eq=False)
class AgentSession:
    """One conversation of an execution (the root's, or a sub-agent's): its token tree and
    the contexts its replies reached."""

    name: str
    tree: Session = attrs.Factory(Session)
    contexts: list[Context] = attrs.Factory(list)
    tool_calls: int = 0
    last: str | None = None  # the content of its latest reply


@attrs.define(eq=False)
class Execution:
    """One agent execution (one rollout group): its sessions by name (``""`` the root), the
    engine runtime and loop its turns run on, the tokenizer and chat format, the run's
    sampling (``base``: the request's temperature, top-p and stop strings may override it,
    its ``max_tokens`` only lower the budget), ``where`` (rollout and prompt, for errors) and
    ``turn_timeout``, the bound on one turn's wait in the server."""

    key: str
    runtime: GenerateRuntime
    loop: asyncio.AbstractEventLoop
    tokenizer: Any
    fmt: ChatFormat
    base: SamplingParams
    where: str
    matcher: str = "strict"
    context_len: int | None = None
    turn_timeout: float = GENERATE_TIMEOUT_S  # the server's wait for a turn (--generate-timeout)
    sessions: dict[str, AgentSession] = attrs.Factory(dict)
    turns: int = 0

    def session(self, name: str) -> AgentSession:
        """The session ``name`` (a sub-agent's is created at its first request)."""
        if name not in self.sessions:
            self.sessions[name] = AgentSession(name)
        return self.sessions[name]

    async def complete(self, name: str, body: dict) -> dict:
        """One chat request of session ``name``: the OpenAI chat.completion (module
        docstring). Raises :class:`RequestError` for a request that cannot run."""
        messages, tools = _checked(body)
        session = self.session(name)
        prompt = self._prompt(session, messages, tools)
        params = self._params(body, prompt)
        gen = await self.runtime.engine.generate(list(prompt), params)
        self.turns += 1
        out = tuple(gen.token_ids)
        ended = bool(out) and out[-1] in self._end_ids
        session.tree = add_turn(session.tree, Turn(
            prompt=prompt, output=out, log_probs=gen.log_probs,
            weight_version=int(gen.weight_version or 0),
            status=FINISH_STATUS[gen.finish_reason], token_versions=gen.token_versions))
        text = self.tokenizer.decode(list(out), skip_special_tokens=True)
        reply = parse_reply(text, self.fmt, first_id=session.tool_calls)
        session.tool_calls += len(reply.tool_calls)
        session.last = reply.content
        message = _message(reply)
        session.contexts.append(Context(messages=[*messages, message], tokens=prompt + out,
                                        ended=ended))
        return _completion(self.key, name, self.turns, message, reply, gen.finish_reason,
                           len(prompt), len(out))

    def samples(self, group_id: Any) -> list[Sample]:
        """Every leaf of every session, in session then creation order, as one group."""
        return [s for session in self.sessions.values()
                for s in leaf_samples(session.tree, group_id=group_id)]

    @property
    def tool_calls(self) -> int:
        return sum(s.tool_calls for s in self.sessions.values())

    def last_reply(self, name: str) -> str:
        """The content of session ``name``'s latest reply ("" when none)."""
        session = self.sessions.get(name)
        return "" if session is None or session.last is None else session.last

    @property
    def _end_ids(self) -> set[int]:
        return {int(t) for t in self.tokenizer.convert_tokens_to_ids([self.fmt.turn_end])}

    def _prompt(self, session: AgentSession, messages: list[dict], tools: list | None
                ) -> tuple[int, ...]:
        """The request's token ids: a stored context's tokens plus the appended messages,
        else the whole conversation rendered (module docstring)."""
        full = self._render(messages, tools, generation=True)
        for context in sorted(session.contexts, key=lambda c: -len(c.messages)):
            k = len(context.messages)
            if k > len(messages) or not all(
                    same_message(a, b, self.matcher)
                    for a, b in zip(context.messages, messages[:k])):
                continue
            before = self._render(context.messages, tools, generation=False)
            opener = self._render(context.messages[:-1], tools, generation=True)
            end = before.rfind(self.fmt.turn_end)
            if not (before.startswith(opener) and full.startswith(before)) or end < len(opener):
                # the template is not append-only here (it rewrites earlier turns, or renders
                # a finished reply unlike the prompt the model answered): render it all
                break
            # what the template writes after the turn's end (Qwen: a newline), never generated
            after = before[end + len(self.fmt.turn_end):]
            bridge = ("" if context.ended else self.fmt.turn_end) + after
            return context.tokens + self._ids(bridge + full[len(before):])
        return self._ids(full)

    def _render(self, messages: list[dict], tools: list | None, *, generation: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - the template's own error, told to the agent
            raise RequestError(f"the chat template cannot render these messages "
                               f"({type(exc).__name__}: {exc})", param="messages") from None

    def _ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _params(self, body: dict, prompt: Sequence[int]) -> SamplingParams:
        """The run's sampling with what the request may set; the budget is the run's response
        limit, lowered by ``max_tokens`` and by the model's context."""
        budget = self.base.max_new_tokens
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        if asked is not None:
            if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
                raise RequestError(f"max_tokens={asked!r} is not a positive integer",
                                   param="max_tokens")
            budget = min(budget, asked)
        if self.context_len is not None:
            room = self.context_len - len(prompt)
            if room < 1:
                raise RequestError(
                    f"this conversation is {len(prompt)} tokens; the model's context is "
                    f"{self.context_len}. Shorten the messages (compact the history)",
                    code="context_length_exceeded", param="messages")
            budget = min(budget, room)
        stop = body.get("stop")
        stops = self.base.stop if stop is None else (stop,) if isinstance(stop, str) else stop
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
            raise RequestError(f"stop={stop!r} is not a string or a list of strings",
                               param="stop")
        changes: dict[str, Any] = {"max_new_tokens": budget, "stop": tuple(stops),
                                   "seed": None if self.base.seed is None
                                   else segment_seed(self.base.seed, self.turns)}
        for key, field in (("temperature", "temperature"), ("top_p", "top_p")):
            value = body.get(key)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise RequestError(f"{key}={value!r} is not a number", param=key)
                changes[field] = float(value)
        try:
            return attrs.evolve(self.base, **changes)
        except VimeError as exc:
            raise RequestError(str(exc)) from None


def _checked(body: Any) -> tuple[list[dict], list | None]:
    """The request's messages and tools, or a :class:`RequestError` naming the field."""
    if not isinstance(body, dict):
        raise RequestError("the body is not a JSON object", code="invalid_json")
    if body.get("stream"):
        raise RequestError("stream=true is not served: the session server answers whole "
                           "completions (drop stream)", param="stream")
    n = body.get("n", 1)
    if n != 1:
        raise RequestError(f"n={n!r}: one choice per request (each request is one turn of the "
                           "session's tree; open more sessions for more samples)", param="n")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}] has no role among {ROLES}",
                               param=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError(f"messages[{i}].content holds a part that is not text",
                                   param=f"messages[{i}].content")
            messages[i] = {**m, "content": "".join(p.get("text", "") for p in content)}
        elif content is not None and not isinstance(content, str):
            raise RequestError(f"messages[{i}].content is not a string",
                               param=f"messages[{i}].content")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("tools must be a list", param="tools")
    return messages, tools


def _message(reply: ParsedReply) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in reply.tool_calls]
    return message


def _completion(key: str, name: str, turn: int, message: dict, reply: ParsedReply,
                finish: str, prompt_tokens: int, completion_tokens: int) -> dict:
    choice: dict[str, Any] = {
        "index": 0, "message": message, "logprobs": None,
        "finish_reason": "tool_calls" if reply.tool_calls else FINISH[finish]}
    if reply.parse_error is not None:  # the anchors' flag: the reply came back as text
        choice["tool_call_parse_error"] = reply.parse_error
    return {"id": f"chatcmpl-{key}{'.' + name if name else ''}-{turn}",
            "object": "chat.completion", "created": 0, "model": "vime",
            "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}

