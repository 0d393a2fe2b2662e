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

``<v>`` is a digit drawn per execution from its ``execution_seed``, never in the prompt. The
model answers each turn with one token and the turn end (a text action: the agent treats a
reply that starts with ``?`` as the call, as a ReAct loop does). Reward: 0 without the lookup,
else 0.1 + 0.9 x (answer == v). An execution that looks the value up gives 3 samples (the
root's first path, the reader's, the compacted branch), one that does not gives 1: the fan-out
the session trees make, in one group whose loss denominator counts every generated token once.

Example: ``python -m vime_shell.agents.lookup_example --run-dir runs/agent`` trains it (the
log prints the reward, samples per execution and tool calls per execution per rollout).
"""

import random
from typing import Any

from openai import AsyncOpenAI

from vime_shell.agents.agent import openai_client
from vime_shell.agents.server import subagent_url

CALL = "?"
PROMPT = "find"


async def _ask(client: AsyncOpenAI, messages: list[Any], kwargs: dict) -> str:
    reply = await client.chat.completions.create(model="vime", messages=messages, **kwargs)
    return reply.choices[0].message.content or ""


async def run_agent(base_url: str, prompt: Any, request_kwargs: dict, metadata: dict,
                    **kwargs: Any) -> dict:
    """One execution (module docstring)."""
    value = str(random.Random(metadata["execution_seed"]).randrange(10))
    turn = {**request_kwargs, "max_tokens": 2}  # one token and the turn's end
    root = openai_client(base_url)
    first = await _ask(root, [{"role": "user", "content": str(prompt)}], turn)
    if not first.startswith(CALL):
        return {"reward": 0.0, "response": first, "metadata": {"looked_up": 0}}
    reader = openai_client(subagent_url(base_url, "reader"))
    note = await _ask(reader, [{"role": "tool", "content": value}], turn)
    summary = [{"role": "user", "content": f"{prompt}={note[:1]}"}]  # the compacted history
    answer = await _ask(root, summary, turn)
    return {"reward": 0.1 + 0.9 * float(answer[:1] == value), "response": answer,
            "metadata": {"looked_up": 1}}
