"""The session server: an OpenAI-compatible chat API in front of the run's engine, one per
process that runs agent executions (an engine leader).

    agent (openai client, or plain HTTP)
      POST /sessions/<key>[.<sub-agent>]/v1/chat/completions
        ─▶ this server's thread: parse JSON, find the execution <key> (404 if none)
        ─▶ the execution's own event loop (where the engine's per-request front lives):
           Execution.complete (agents/sessions.py: tokens, engine, tree, reply)
        ─▶ the chat.completion, or an OpenAI-style error body (never a traceback)

Why FastAPI on uvicorn: it is what vLLM's own OpenAI server runs, so the request and response
shapes, keep-alive and concurrency behave as agents written against vLLM expect; the server
runs on a daemon thread with its own event loop, bound to 127.0.0.1 on a free port, and hands
each turn to the loop of the execution that owns the session (``run_coroutine_threadsafe``),
so the engine front is only ever used from its own loop. Sessions are isolated by their
random key: a request names one execution and sees nothing of another.

Example: ``server = shared_server(); server.url("ab12")`` is
``http://127.0.0.1:<port>/sessions/ab12/v1``, a ``base_url`` for ``openai.AsyncOpenAI``.
"""

import asyncio
import json
import logging
import re
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from vime_shell.agents.sessions import Execution, RequestError

log = logging.getLogger("vime.agents")
HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class SessionServer:
    """The server and the executions it serves (module docstring)."""

    def __init__(self) -> None:
        self.executions: dict[str, Execution] = {}
        self.app = FastAPI(title="vime sessions", docs_url=None, redoc_url=None)
        self.app.post("/sessions/{sid}/v1/chat/completions")(self._chat)
        self.app.get("/sessions/{sid}/v1/models")(self._models)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((HOST, 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning",
                                                    lifespan="off", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True, name="vime-sessions")
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent session server did not start on {HOST}:"
                                   f"{self.port} within {START_TIMEOUT_S:g} s")
            time.sleep(0.01)

    def url(self, key: str, name: str = "") -> str:
        """The ``base_url`` of session ``key`` (a sub-agent's with ``name``)."""
        return f"http://{HOST}:{self.port}/sessions/{key}{'.' + name if name else ''}/v1"

    def open(self, execution: Execution) -> str:
        self.executions[execution.key] = execution
        return self.url(execution.key)

    def close(self, key: str) -> None:
        self.executions.pop(key, None)

    async def _models(self, sid: str) -> dict:
        return {"object": "list", "data": [{"id": "vime", "object": "model", "created": 0,
                                            "owned_by": "vime"}]}

    async def _chat(self, sid: str, request: Request) -> Any:
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return _error(RequestError(f"the body is not JSON ({exc})", code="invalid_json"))
        key, _, name = sid.partition(".")
        execution = self.executions.get(key)
        if execution is None:
            return _error(RequestError(f"no session {sid!r}: it never existed or its "
                                       "execution ended", status=404, code="not_found"))
        if name and not _NAME.fullmatch(name):
            return _error(RequestError(f"sub-agent name {name!r} is not 1-64 letters, digits, "
                                       "'_' or '-'", code="invalid_session"))
        future = asyncio.run_coroutine_threadsafe(execution.complete(name, body),
                                                  execution.loop)
        try:  # bounded: an execution whose loop ended never answers
            return await asyncio.wait_for(asyncio.wrap_future(future), execution.turn_timeout)
        except RequestError as exc:
            return _error(exc)
        except TimeoutError:
            future.cancel()
            return _error(RequestError(
                f"the turn did not finish within {execution.turn_timeout:g} s (its execution "
                "may have ended)", status=504, code="timeout"))
        except Exception as exc:  # noqa: BLE001 - the agent gets a message, the log the rest
            log.warning("agent session %s (%s): %s: %s", sid, execution.where,
                        type(exc).__name__, exc)
            return _error(RequestError(f"the turn failed ({type(exc).__name__}: {exc})",
                                       status=500, code="server_error"))


def _error(exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def subagent_url(base_url: str, name: str) -> str:
    """The ``base_url`` of a sub-agent session ``name`` of the execution whose ``base_url`` is
    given: its requests become leaves of the same group. Example: ``subagent_url(
    "http://127.0.0.1:8000/sessions/ab12/v1", "search")`` ends in ``/sessions/ab12.search/v1``.
    """
    head, sep, tail = base_url.rstrip("/").rpartition("/sessions/")
    key = tail.split("/", 1)[0].split(".", 1)[0]
    return f"{head}{sep}{key}.{name}/v1"


_SERVER: SessionServer | None = None
_LOCK = threading.Lock()


def shared_server() -> SessionServer:
    """This process's server, started at the first agent execution."""
    global _SERVER
    with _LOCK:
        if _SERVER is None:
            _SERVER = SessionServer()
            log.info("agent session server on http://%s:%d", HOST, _SERVER.port)
        return _SERVER
