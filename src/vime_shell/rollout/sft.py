"""Supervised fine-tuning data as samples: slime's ``sft_rollout`` (``--rollout-function-path
vime_shell.rollout.sft:sft_rollout``; slime's path ``slime.rollout.sft_rollout.generate_rollout``
names it too), trained with ``--loss-type sft_loss``.

Each dataset row is a conversation (``--input-key`` holding chat messages, ``--tool-key`` its
tools). :func:`conversation_tokens` renders it with the tokenizer's chat template and marks
what the model must learn to write: the tokens each assistant turn adds after the template's
generation prompt (its content and its end-of-turn tokens), loss mask 1; system, user and tool
turns and every role header, 0. The sample's response starts at the first assistant token, so
its ``loss_mask`` covers the conversation from there (the user turns between two assistant
turns are 0). Nothing is generated (the engine is not asked) and the reward is 0.

The turns are found by rendering growing prefixes of the conversation: turn ``i``'s tokens are
what ``messages[:i + 1]`` adds to ``messages[:i]``, and an assistant turn's header is what it
shares with ``messages[:i]`` rendered with the generation prompt. So it needs a template whose
rendering of a conversation begins with its rendering of every prefix (true of Qwen's, Llama's
and most; a template that rewrites earlier turns, such as one that drops earlier reasoning, is
a :class:`TaskError` naming the turn).

``--loss-mask-type`` (slime's flag) picks how the trained tokens are found
(:data:`LOSS_MASK_TYPES`): ``qwen`` and ``qwen3`` (slime's default, and unset) are the
turn-by-turn rendering above; ``qwen3_5`` renders the conversation once, for templates that
rewrite earlier turns (Qwen3.5's drops their reasoning), and marks the text of each assistant
turn between the template's ``<|im_start|>assistant`` header and its ``<|im_end|>`` (a leading
``<think>`` line excluded), mapped to tokens by the tokenizer's offsets; ``distill_qwen``
trains on the last message's content after the first message rendered with the generation
prompt. With every type a message with ``"step_loss_mask": 0`` is not trained on, as in slime.

Example (the embedded model's template: turns joined by ``#``, generation prompt ``=``):
``[user "12>", assistant "21"]`` renders ``12>#21``; the tokens are ``1 2 > # 2 1`` with loss
mask ``0 0 0 1 1 1`` (the template has no assistant header: ``=`` is not part of ``#21``).
"""

from collections.abc import Callable
from typing import Any

from vime_pure.data.sample import Sample
from vime_pure.errors import field_error, one_line
from vime_shell.rollout.functions import RolloutContext, first_request
from vime_shell.rollout.tasks import TaskError, TaskExample


def _render(tokenizer: Any, messages: list[dict], tools: Any, generation: bool) -> list[int]:
    if not messages:
        return []
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=generation)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _generation_prompt(tokenizer: Any, before: list[dict], message: dict, tools: Any,
                       ids: list[int]) -> list[int]:
    """What the template adds for a reply after ``before`` (rendered as ``ids``). Before an
    opening assistant turn (templates refuse an empty conversation) it is read after a
    stand-in user turn holding the reply's own text."""
    if before:
        return _render(tokenizer, before, tools, generation=True)[len(ids):]
    probe = [{"role": "user", "content": message.get("content") or ""}]
    bare = _render(tokenizer, probe, tools, generation=False)
    return _render(tokenizer, probe, tools, generation=True)[len(bare):]


def conversation_tokens(tokenizer: Any, messages: Any, tools: Any = None,
                        mask_type: str | None = None) -> tuple[list[int], list[int]]:
    """``(token ids, loss mask)`` of a whole conversation, by ``mask_type`` (module
    docstring; None: ``qwen``)."""
    _check_conversation(messages)
    return LOSS_MASK_TYPES[mask_type or "qwen"](tokenizer, messages, tools)


def _trained(message: dict) -> bool:
    return message["role"] == "assistant" and message.get("step_loss_mask", 1) == 1


def _check_conversation(messages: Any) -> None:
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m for m in messages):
        raise field_error(TaskError, "prompt", one_line(repr(messages))[:120],
                          "is not a conversation (a list of chat messages with roles)",
                          "point --input-key at the rows' messages for sft_rollout")
    if not any(m["role"] == "assistant" for m in messages):
        raise field_error(TaskError, "prompt", one_line(repr(messages))[:120],
                          "has no assistant turn: nothing to learn",
                          "drop such rows, or give each an assistant reply")


def _by_turns(tokenizer: Any, messages: list[dict], tools: Any) -> tuple[list[int], list[int]]:
    """Growing prefixes of the conversation, one turn at a time (module docstring)."""
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        grown = _render(tokenizer, messages[:i + 1], tools, generation=False)
        if grown[:len(ids)] != ids:
            raise TaskError(f"the chat template renders turn {i} ({message['role']}) by "
                            "rewriting the turns before it, so a conversation's tokens are not "
                            "its turns' tokens in order. Fix: use a template that keeps "
                            "earlier turns as they were (sft_rollout renders growing prefixes)")
        added = grown[len(ids):]
        header = 0
        if message["role"] == "assistant":
            prompt = _generation_prompt(tokenizer, messages[:i], message, tools, ids)
            while header < min(len(prompt), len(added)) and prompt[header] == added[header]:
                header += 1
        ids += added
        mask += [0] * header + [int(_trained(message))] * (len(added) - header)
    return ids, mask


_HEADER, _THINK, _END = "<|im_start|>assistant\n", "<think>\n", "<|im_end|>"


def _by_spans(tokenizer: Any, messages: list[dict], tools: Any) -> tuple[list[int], list[int]]:
    """The conversation rendered once; each assistant turn's text from its header to its
    ``<|im_end|>`` (and the newline after it), without a leading ``<think>`` line, marked and
    mapped to tokens by their character offsets (slime's ``qwen3_5``)."""
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if encoded.get("offset_mapping") is None:
        raise TaskError("--loss-mask-type qwen3_5 maps text to tokens by their offsets, which "
                        "this tokenizer does not give. Fix: use the model's fast tokenizer "
                        "(tokenizer.json), or another --loss-mask-type")
    marked = [0] * (len(text) + 1)  # prefix sums of the trained characters
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        header = text.find(_HEADER, cursor)
        end = text.find(_END, header + len(_HEADER)) if header >= 0 else -1
        if end < 0:
            raise field_error(TaskError, "prompt", one_line(repr(messages))[:120],
                              f"renders assistant turn {i} without Qwen's {_HEADER!r} ... "
                              f"{_END!r} around it", "use --loss-mask-type qwen with this "
                              "model's template")
        start, cursor = header + len(_HEADER), end + len(_END)
        cursor += text[cursor:cursor + 1] == "\n"
        if text.startswith(_THINK, start):
            start += len(_THINK)
        if _trained(message):
            for c in range(start, cursor):
                marked[c + 1] = 1
    for c in range(len(text)):
        marked[c + 1] += marked[c]
    mask = [int(b > a and marked[b] > marked[a]) for a, b in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


def _distill(tokenizer: Any, messages: list[dict], tools: Any) -> tuple[list[int], list[int]]:
    """The first message as the prompt (generation prompt added), the last one's content as
    the response (slime's ``distill_qwen``)."""
    prompt = _render(tokenizer, messages[:1], tools, generation=True)
    response = list(tokenizer(messages[-1]["content"] or "",
                              add_special_tokens=False)["input_ids"])
    return prompt + response, [0] * len(prompt) + [int(_trained(messages[-1]))] * len(response)


# --loss-mask-type: slime's names -> how the trained tokens are found (module docstring)
LOSS_MASK_TYPES: dict[str, Callable[[Any, list[dict], Any], tuple[list[int], list[int]]]] = {
    "qwen": _by_turns, "qwen3": _by_turns, "qwen3_5": _by_spans, "distill_qwen": _distill}


def sft_sample(tokenizer: Any, example: TaskExample, *, group_id: int, index: int,
               mask_type: str | None = None) -> Sample:
    """One conversation as a training sample: its response from the first trained token."""
    tokens, mask = conversation_tokens(tokenizer, example.prompt, example.tools, mask_type)
    if 1 not in mask:
        raise field_error(TaskError, "prompt", one_line(repr(example.prompt))[:120],
                          "has assistant turns the template renders as headers only",
                          "give each assistant turn content")
    first = mask.index(1)
    return Sample(tokens=tokens, response_length=len(tokens) - first, loss_mask=mask[first:],
                  reward=0.0, group_id=group_id, index=index,
                  metadata={**example.metadata, "prompt": example.prompt,
                            "label": example.label, "turn": 0})


def sft_rollout(ctx: RolloutContext) -> list[list[Sample]]:
    """``output[p]``: prompt ``p``'s conversation as one sample, its own group
    (``--n-samples-per-prompt`` is 1: the settings refuse another value with this function)."""
    first = first_request(ctx, len(ctx.prompts))
    return [[sft_sample(ctx.tokenizer, example, group_id=ctx.first_group_id + first + p,
                        index=first + p, mask_type=ctx.loss_mask_type)]
            for p, example in enumerate(ctx.prompts)]

