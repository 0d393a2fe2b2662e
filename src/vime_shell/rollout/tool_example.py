"""A multi-turn tool-use ``generate`` for the embedded model: the agentic contract, end to end.

``--custom-generate-function-path vime_shell.rollout.tool_example:generate`` on the built-in
``reverse2`` task (``"47>"`` -> ``"74"``). The model may answer at once, or call the
**reverse tool** by emitting ``TOOL_CALL`` (``"b"``, a stop token of its first turn): the tool
reads the prompt's digits and answers them reversed followed by ``"="``, which is appended to
the response with loss mask 0 (the model did not write it); the model then answers in a
second turn. One sample per execution (one rollout group), graded by the run's reward on its
final answer (``metadata["response"]`` is the answer; ``metadata["tool_calls"]`` counts calls).

    "47>" -> "b" [tool: "74="] "74"      response tokens b,7,4,=,7,4 with loss mask 1,0,0,0,1,1
    "47>" -> "74"                        no call: a plain answer

Each turn awaits the built-in :func:`vime_shell.rollout.generate.generate`, with per-request
stop tokens, as slime's multi-turn functions do with slime's ``generate``; an aborted turn
(partial rollouts) returns at once, and a resumed execution picks up where it stopped (the
response's text says whether the tool already ran).
"""

from typing import Any

from vime_pure.data.sample import Sample, Status
from vime_shell.rollout.generate import append_tokens, current_runtime
from vime_shell.rollout.generate import generate as generate_turn

TOOL_CALL = "b"
TOOL_END = "="
ANSWER_TOKENS = 2


def reverse_tool(prompt: str) -> str:
    """The tool: the prompt's digits reversed, then ``TOOL_END``.
    Example: ``reverse_tool("47>") == "74="``."""
    return "".join(c for c in prompt if c.isdigit())[::-1] + TOOL_END


async def generate(args: Any, sample: Sample, sampling_params: dict) -> Sample:
    """One execution: up to one tool call, then the answer (see the module docstring)."""
    tok = current_runtime().tokenizer
    call_id = tok.convert_tokens_to_ids(TOOL_CALL)
    output = reverse_tool(str(sample.metadata["prompt"]))
    if TOOL_CALL + output not in _response_text(sample, tok):
        # turn 1: answer, or call the tool (its token stops the turn)
        first = {**sampling_params, "max_new_tokens": ANSWER_TOKENS,
                 "stop_token_ids": [*sampling_params.get("stop_token_ids", []), call_id]}
        sample = await generate_turn(args, sample, first)
        if sample.status is Status.ABORTED:
            return sample
        text = sample.metadata["response"]
        if not text.endswith(TOOL_CALL):
            sample.metadata.update(tool_calls=0)
            return sample
        append_tokens(sample, tok(output, add_special_tokens=False)["input_ids"], loss_mask=0)
    # turn 2: the answer after the tool's output
    answered = len(_response_text(sample, tok).rpartition(TOOL_CALL + output)[2])
    budget = {**sampling_params,
              "max_new_tokens": sample.response_length + ANSWER_TOKENS - answered}
    sample = await generate_turn(args, sample, budget)
    if sample.status is not Status.ABORTED:
        answer = sample.metadata["response"].rpartition(TOOL_CALL + output)[2]
        sample.metadata.update(response=answer, tool_calls=1)
    return sample


def _response_text(sample: Sample, tok: Any) -> str:
    """The response so far as text (tool output included)."""
    response = list(sample.tokens[len(sample.tokens) - sample.response_length:])
    return tok.decode(response, skip_special_tokens=True) if response else ""
