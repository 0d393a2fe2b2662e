"""``--custom-agent-function-path``: an agent program as one rollout execution, miles' contract.

The agent is ``async def run_agent(base_url, prompt, request_kwargs, metadata, **kw) -> dict |
None``. It talks to the run's engine only through ``base_url``, an OpenAI-compatible session
(``/chat/completions``; usable by the official ``openai`` client and by plain HTTP), and may
open sub-agent sessions in the same group with :func:`vime_shell.agents.server.subagent_url`.

    generate(args, sample, params)      (the per-sample driver's function, one execution)
      ─▶ an Execution (agents/sessions.py) registered on this process's session server
      ─▶ await run_agent(base_url, prompt, request_kwargs, metadata)   (the agent's turns)
      ─▶ every leaf of every session as a Sample, one group (the driver gives the group id)

- ``prompt``: the dataset row's prompt (a string, or the messages list of a chat dataset);
  ``request_kwargs``: the run's sampling as OpenAI arguments (``max_tokens``, ``temperature``,
  ``top_p``); ``metadata``: the row's metadata and ``label``, and ``execution_seed`` (the
  execution's sampling seed: an agent that draws anything, a task's hidden value, draws it from
  this, so a run is reproducible).
- The returned dict may carry ``reward`` (a number: every leaf gets it) and ``metadata`` (merged
  into each leaf's; its ``tool_calls``, an agent's own count of the tools it ran, replaces the
  count of tool calls the server parsed, which every leaf carries and the run's record averages
  per execution as ``tool_calls_per_group_mean``); without a reward, ``--rm-type`` / ``--custom-rm-path`` grade the leaves
  on the agent's final answer (``response`` in the dict, else the root session's last reply).
- An agent that raises fails its execution with :class:`AgentError` naming the session and
  the prompt; one that never returns meets ``--generate-timeout``; one that made no request
  (no generated token) is an :class:`AgentError` too. A session ends with its execution: a
  later request gets a 404.

Any client works; :func:`openai_client` builds one without an SSL context (~2 ms instead of
~20) and closes it, with its connections, when the execution ends (a client the agent makes
itself is the agent's to close: ``async with``).

Example::

    async def run_agent(base_url, prompt, request_kwargs, metadata, **kw):
        client = openai_client(base_url)  # or openai.AsyncOpenAI(base_url=base_url, ...)
        reply = await client.chat.completions.create(
            model="vime", messages=[{"role": "user", "content": prompt}], **request_kwargs)
        return {"response": reply.choices[0].message.content}
"""

import asyncio
import contextlib
import contextvars
import inspect
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import openai

from vime_pure.data.sample import Sample
from vime_pure.data.tool_calls import chat_format
from vime_pure.errors import VimeError, field_error
from vime_shell.agents.server import shared_server
from vime_shell.agents.sessions import Execution
from vime_shell.rollout.functions import GENERATE_TIMEOUT_S
from vime_shell.rollout.generate import current_runtime, engine_params
from vime_shell.rollout.plugins import PluginError, load_callable

FLAG = "--custom-agent-function-path"
_AGENTS: dict[str, Callable[..., Any]] = {}
# the clients openai_client made for the running execution, closed when it ends
_CLIENTS: contextvars.ContextVar[list | None] = contextvars.ContextVar("vime_agent_clients",
                                                                        default=None)


class AgentError(VimeError):
    """An agent execution that failed or produced nothing to train."""


def openai_client(base_url: str) -> openai.AsyncOpenAI:
    """An ``openai.AsyncOpenAI`` for ``base_url`` that the execution closes when it ends (its
    connections with it, so a long run holds no socket of a finished execution). Its HTTP
    client skips the SSL context the server's plain-HTTP URL never uses: ~2 ms to build, not
    ~20. Example: ``await openai_client(base_url).chat.completions.create(model="vime",
    messages=...)``."""
    # openai's own HTTP client class (httpx, or its fork in openai 3)
    http = openai.DefaultAsyncHttpxClient(verify=False)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="vime", max_retries=0,
                                http_client=http)
    owned = _CLIENTS.get()
    if owned is not None:
        owned.append(client)
    return client


@contextlib.asynccontextmanager
async def closing_clients() -> AsyncIterator[None]:
    """Close every client :func:`openai_client` makes inside (an execution's)."""
    token = _CLIENTS.set([])
    try:
        yield
    finally:
        for client in _CLIENTS.get() or ():
            await client.close()
        _CLIENTS.reset(token)


def load_agent(path: str) -> Callable[..., Any]:
    """``run_agent`` of ``path``, checked: an async function that takes ``base_url``,
    ``prompt``, ``request_kwargs`` and ``metadata``."""
    if path not in _AGENTS:
        fn = load_callable(path, flag=FLAG)
        if not inspect.iscoroutinefunction(fn):
            raise field_error(PluginError, FLAG, path, "is not an async function",
                              "define `async def run_agent(base_url, prompt, request_kwargs, "
                              "metadata, **kwargs)`")
        try:
            inspect.signature(fn).bind(base_url="", prompt="", request_kwargs={}, metadata={})
        except TypeError:
            raise field_error(PluginError, FLAG, path, "does not take base_url, prompt, "
                              "request_kwargs and metadata", "use miles' signature "
                              "run_agent(base_url, prompt, request_kwargs, metadata, "
                              "**kwargs)") from None
        _AGENTS[path] = fn
    return _AGENTS[path]


async def generate(args: Any, sample: Sample, sampling_params: dict) -> Sample | list[Sample]:
    """One agent execution (module docstring)."""
    run_agent = load_agent(args.custom_agent_function_path)
    rt = current_runtime()
    base = engine_params(sampling_params)
    where = (f"prompt {sample.metadata.get('prompt')!r:.80}"
             f" (execution {sample.index}, {FLAG} {args.custom_agent_function_path})")
    execution = Execution(
        key=secrets.token_hex(8), runtime=rt, loop=asyncio.get_running_loop(),
        tokenizer=rt.tokenizer, fmt=chat_format(args.tito_model), base=base, where=where,
        matcher=args.session_message_matcher, context_len=rt.context_len,
        turn_timeout=float(getattr(args, "generate_timeout", GENERATE_TIMEOUT_S)))
    server = shared_server()
    base_url = server.open(execution)
    kwargs = {"max_tokens": base.max_new_tokens, "temperature": base.temperature,
              "top_p": base.top_p}
    metadata = {**sample.metadata, "execution_seed": sampling_params.get("sampling_seed")}
    try:
        async with closing_clients():
            result = await run_agent(base_url=base_url, prompt=metadata.get("prompt"),
                                     request_kwargs=kwargs, metadata=metadata)
    except VimeError:
        raise
    except Exception as exc:  # noqa: BLE001 - the agent's own code
        raise AgentError(f"{where}: the agent of session {execution.key} raised "
                         f"{type(exc).__name__}: {exc}. Fix: correct the agent, or catch "
                         "what it may raise and return None") from exc
    finally:
        server.close(execution.key)
    return _leaves(execution, sample, result, where)


def _leaves(execution: Execution, sample: Sample, result: Any, where: str
            ) -> Sample | list[Sample]:
    """The execution's leaves, annotated and rewarded as the module docstring says."""
    if result is not None and not isinstance(result, dict):
        raise AgentError(f"{where}: the agent returned a {type(result).__name__}. Fix: return "
                         "a dict (reward, response, metadata) or None")
    result = result or {}
    leaves = execution.samples(sample.group_id)
    if not leaves:
        raise AgentError(f"{where}: the agent of session {execution.key} made no request that "
                         "generated a token, so the execution has nothing to train. Fix: call "
                         "the chat completions API at base_url at least once")
    reward = result.get("reward")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        raise AgentError(f"{where}: reward={reward!r} is not a number. Fix: return a float")
    extra = result.get("metadata") or {}
    response = result.get("response")
    if response is None:
        response = execution.last_reply("")
    # the tool calls the server parsed, unless the agent counts its own (text actions)
    calls = extra.get("tool_calls", execution.tool_calls)
    for leaf in leaves:
        leaf.metadata = {**sample.metadata, **extra, "response": response,
                         "agent_session": execution.key, "tool_calls": calls,
                         "samples_in_execution": len(leaves)}
        leaf.index = sample.index
        if reward is not None:
            leaf.reward = float(reward)
    return leaves if len(leaves) > 1 else leaves[0]
