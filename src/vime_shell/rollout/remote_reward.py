"""``--rm-url``: a remote reward server, called as slime calls it.

Each sample is one HTTP ``POST`` of ``{"prompt", "response", "label"}`` (JSON) to the URL; the
JSON reply is the reward (a number, or a dict read through ``--reward-key``). It is an
``async def remote_rm(args, sample)``, so the samples of one prompt are in flight at once
(``reward_plugins``), each request in a worker thread (the standard library's ``urllib``, no
extra dependency). A request that fails (connection refused, timeout, HTTP 5xx, a reply that is
not JSON) is retried ``RM_URL_RETRIES`` times with exponential backoff, then raises
:class:`RemoteRewardError` naming the URL and the last failure; HTTP 4xx is not retried (the
request itself is wrong).

Example: a server answering ``{"score": 1.0}`` with ``--rm-url http://127.0.0.1:8000/reward
--reward-key score`` gives each sample the reward 1.0.
"""

import asyncio
import json
import time
import urllib.error
import urllib.request
from typing import Any

from vime_shell.rollout.rewards import RewardFunctionError

RM_URL_TIMEOUT_S = 60.0  # per request; --reward-timeout (when given) bounds it instead
RM_URL_RETRIES = 4  # after the first attempt
RM_URL_BACKOFF_S = 0.5  # first wait; doubled per retry (0.5, 1, 2, 4 s)


class RemoteRewardError(RewardFunctionError):
    """The reward server did not give a usable answer after every retry."""


def _post(url: str, payload: dict[str, Any], timeout: float) -> Any:
    body = json.dumps(payload).encode()
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read().decode())


def _retryable(exc: Exception) -> bool:
    if isinstance(exc, urllib.error.HTTPError):
        return exc.code >= 500 or exc.code == 429
    return isinstance(exc, (OSError, ValueError))  # URLError, timeouts, a non-JSON reply


def post_with_retries(url: str, payload: dict[str, Any], timeout: float, *,
                      error: type[Exception], what: str, fix: str) -> Any:
    """One POST, retried ``RM_URL_RETRIES`` times with exponential backoff where the
    failure may pass (module docstring); then ``error`` naming ``what``, the failure and
    ``fix``. Blocking: call it on a worker thread."""
    wait = RM_URL_BACKOFF_S
    for attempt in range(RM_URL_RETRIES + 1):
        try:
            return _post(url, payload, timeout)
        except Exception as exc:  # noqa: BLE001 - classified just below
            if attempt == RM_URL_RETRIES or not _retryable(exc):
                raise error(f"{what}: {type(exc).__name__}: {exc} (attempt {attempt + 1} of "
                            f"{RM_URL_RETRIES + 1}). Fix: {fix}.") from exc
            time.sleep(wait)
            wait *= 2
    raise AssertionError("unreachable: the last attempt returns or raises")


async def remote_rm(args: Any, sample: Any) -> Any:
    """slime's ``remote_rm``: POST the sample's text to ``args.rm_url`` (module docstring)."""
    url = args.rm_url
    timeout = getattr(args, "reward_timeout", None) or RM_URL_TIMEOUT_S
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    return await asyncio.to_thread(post_with_retries, url, payload, timeout,
                                   error=RemoteRewardError, what=f"--rm-url={url}",
                                   fix="start the reward server or correct the URL")
