"""The agent example: a value only a tool call reveals, a sub-agent that reads the tool's
result, and a compacted history; trained with ``--custom-agent-function-path
vime_shell.agents.lookup_example:run_agent`` on the char-level agent model
(``vime_shell.models.chat_model.build_agent_chat_model``).

One execution, every turn through the session server with the ``openai`` client::

    root    [user: "find"]                         -> "?"   the lookup (any other reply: the
                                                             answer is unknowable, reward 0)
    reader  [tool: "<v>"]              (sub-agent) -> "<v>" reads the tool's result out
    root    [user: "find=<n>"]   (history compacted to a summary with the reader's note)
                                                   -> "<v>" the answer

``<v>`` is a digit below ``VALUES`` drawn per execution from its ``execution_seed``, never in
the prompt. The model answers each turn with one token and the turn end (a text action: the
agent treats a reply that starts with ``?`` as the call, as a ReAct loop does, and reports
its own ``tool_calls``). Reward: 0 without the lookup,
else 0.2 + 0.4 x score(the reader's note) + 0.4 x score(answer), where a reply scores 1 for
the value and 0.25 for another digit: 1 only when both copy the value, 0.4 for a run that
calls the tool and guesses digits. Warm-up rows ``"=<d>"`` (no tool) score their answer the
same way and teach the copy. An execution that looks the value up gives 3 samples (the
root's first path, the reader's, the compacted branch), one that does not gives 1: the fan-out
the session trees make, in one group whose loss denominator counts every generated token once.

Trained from scratch on CPU by ``python -m benchmarks.agent_example`` (400 rollouts, ~5 min:
the reward curve, samples per execution and the tool-call rate; ``docs/agents.md``).
"""

import random
from typing import Any

from openai import AsyncOpenAI

from vime_shell.agents.agent import openai_client
from vime_shell.agents.server import subagent_url

CALL = "?"
PROMPT = "find"
VALUES = 4  # the hidden value is a digit below this


def score(reply: str, value: str) -> float:
    """1 for the value, 0.25 for another digit (the answer's kind), else 0."""
    first = reply[:1]
    return 1.0 if first == value else 0.25 if first.isdigit() else 0.0


def rows(n: int, *, warm_up: float = 0.5, seed: int = 0) -> list[dict]:
    """``n`` prompt rows: ``"find"`` (the lookup) and, a ``warm_up`` fraction of them, ``"=<d>"``
    rows that teach the copy the lookup's later turns need (reward 1 for the digit)."""
    rng = random.Random(seed)
    return [{"prompt": f"={rng.randrange(VALUES)}" if rng.random() < warm_up else PROMPT,
             "label": ""} for _ in range(n)]


async def _ask(client: AsyncOpenAI, messages: list[Any], kwargs: dict) -> str:
    reply = await client.chat.completions.create(model="vime", messages=messages, **kwargs)
    return reply.choices[0].message.content or ""


async def run_agent(base_url: str, prompt: Any, request_kwargs: dict, metadata: dict,
                    **kwargs: Any) -> dict:
    """One execution (module docstring)."""
    turn = {**request_kwargs, "max_tokens": 2}  # one token and the turn's end
    root = openai_client(base_url)
    if prompt != PROMPT:  # a warm-up row, "=<d>": answer the digit (no tool needed)
        answer = await _ask(root, [{"role": "user", "content": str(prompt)}], turn)
        return {"reward": score(answer, str(prompt)[-1:]), "response": answer,
                "metadata": {"tool_calls": 0}}
    value = str(random.Random(metadata["execution_seed"]).randrange(VALUES))
    first = await _ask(root, [{"role": "user", "content": str(prompt)}], turn)
    if not first.startswith(CALL):
        return {"reward": 0.0, "response": first, "metadata": {"tool_calls": 0}}
    reader = openai_client(subagent_url(base_url, "reader"))
    note = await _ask(reader, [{"role": "tool", "content": value}], turn)
    summary = [{"role": "user", "content": f"{prompt}={note[:1]}"}]  # the compacted history
    answer = await _ask(root, summary, turn)
    reward = 0.2 + 0.4 * score(note, value) + 0.4 * score(answer, value)
    return {"reward": reward, "response": answer, "metadata": {"tool_calls": 1}}
