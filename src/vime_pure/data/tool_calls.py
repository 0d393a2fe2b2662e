"""A model family's chat turn format: how its replies carry tool calls, and what its template
writes around an assistant turn, so an agent session can append turns without re-tokenising.

Each family is one small :class:`ChatFormat` record in ``FORMATS`` (Qwen first: Qwen2.5 and
Qwen3 write ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks and end a
turn with ``<|im_end|>``). :func:`parse_reply` splits a reply's text into
the content and the tool calls; a block that does not parse leaves the whole reply as text with
``parse_error`` set (the anchors' behaviour: the agent sees what the model wrote, the turn
still trains). Pure: no tokenizer here (the shell checks a template against its format).

Example: ``parse_reply('hi<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>',
FORMATS["qwen"])`` gives content ``"hi"`` and one call ``f`` with arguments ``'{"x": 1}'``.
"""

import json
import re

import attrs

from vime_pure.errors import VimeError, field_error


class ChatFormatError(VimeError):
    """A chat format that is not known or not well formed."""


@attrs.frozen(kw_only=True)
class ChatFormat:
    """One model family's turn format. ``tool_open`` / ``tool_close`` delimit a tool call's
    JSON object (``{"name": ..., "arguments": ...}``); ``turn_end``: the text that ends an
    assistant turn (the model's stop token; what the template writes after it, such as
    Qwen's newline, is read from the template itself)."""

    name: str
    tool_open: str = "<tool_call>"
    tool_close: str = "</tool_call>"
    turn_end: str = "<|im_end|>"

    def __attrs_post_init__(self) -> None:
        for field in ("name", "tool_open", "tool_close", "turn_end"):
            if not isinstance(getattr(self, field), str) or not getattr(self, field):
                raise field_error(ChatFormatError, field, getattr(self, field),
                                  "must be a non-empty string", "name the format's markers")


FORMATS: dict[str, ChatFormat] = {"qwen": ChatFormat(name="qwen")}


@attrs.frozen(kw_only=True)
class ToolCall:
    """One parsed call: an ``id`` unique in its session, the function ``name`` and its
    ``arguments`` as JSON text (OpenAI's shape)."""

    id: str
    name: str
    arguments: str


@attrs.frozen(kw_only=True)
class ParsedReply:
    """A reply's ``content`` (None when only tool calls remain), its ``tool_calls`` and, when
    a block did not parse, ``parse_error`` (then the content is the whole reply)."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    parse_error: str | None = None


def chat_format(name: str) -> ChatFormat:
    """``FORMATS[name]``, or a typed error naming the choices."""
    if name not in FORMATS:
        raise field_error(ChatFormatError, "chat format", name, "is not known",
                          f"use one of {sorted(FORMATS)}")
    return FORMATS[name]


def parse_reply(text: str, fmt: ChatFormat, *, first_id: int = 0) -> ParsedReply:
    """``text`` (the reply, its ``turn_end`` already cut) as content and tool calls; call ids
    are ``call_<first_id + k>``. Example: module docstring."""
    pattern = re.compile(re.escape(fmt.tool_open) + r"(.*?)" + re.escape(fmt.tool_close),
                         re.DOTALL)
    calls = []
    for k, match in enumerate(pattern.finditer(text)):
        try:
            obj = json.loads(match.group(1))
            name, arguments = obj["name"], obj.get("arguments", {})
            if not isinstance(name, str) or not isinstance(arguments, (dict, str)):
                raise TypeError("name must be a string and arguments an object")
        except (ValueError, KeyError, TypeError) as exc:
            return ParsedReply(content=text, parse_error=f"tool call {k} does not parse as "
                               f"{fmt.name}'s JSON ({type(exc).__name__}: {exc})")
        calls.append(ToolCall(id=f"call_{first_id + k}", name=name,
                              arguments=arguments if isinstance(arguments, str)
                              else json.dumps(arguments, ensure_ascii=False)))
    if not calls:
        if fmt.tool_open in text:
            return ParsedReply(content=text, parse_error=f"an unclosed {fmt.tool_open} block")
        return ParsedReply(content=text)
    rest = pattern.sub("", text).strip()
    return ParsedReply(content=rest or None, tool_calls=tuple(calls))
