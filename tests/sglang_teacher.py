"""A stand-in for an SGLang teacher server (``python -m sglang.launch_server``) on CPU: its
native ``/generate`` with ``return_logprob`` and ``max_new_tokens 0``, as slime's and miles'
on-policy distillation call it, answered by a transformers model in this process.

The reply has SGLang's shape: ``meta_info.input_token_logprobs`` holds one ``[log-prob, token
id, None]`` per input token, the first one's log-prob None (nothing predicts it). With
``top_logprobs_num`` K, ``input_top_logprobs`` holds each input token's K most likely
``[log-prob, id, None]``; with ``token_ids_logprob`` (or the per-position
``token_ids_logprob_positions``), ``input_token_ids_logprobs`` holds those ids' entries; the
first position of both is None. Every request body is recorded in ``requests``;
``fail_first`` requests are answered 503 first (the client retries them)."""

import http.server
import json
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def position_log_probs(model, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens) - 1, V]``: the log-probs of input token ``j + 1`` given the ones before."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def teacher_log_probs(model, tokens: list[int]) -> list[float | None]:
    """Each token's log-prob under ``model`` given the tokens before it (None for the first)."""
    picked = position_log_probs(model, tokens).gather(1, torch.tensor(tokens[1:])[:, None])
    return [None, *picked[:, 0].tolist()]


def _meta(model, body: dict) -> dict:
    """SGLang's ``meta_info`` for one scoring request (module docstring)."""
    tokens = body["input_ids"]
    full = position_log_probs(model, tokens)
    entries = [[lp, t, None] for lp, t in zip(teacher_log_probs(model, tokens), tokens)]
    meta = {"input_token_logprobs": entries, "prompt_tokens": len(entries),
            "completion_tokens": 0}
    k = body.get("top_logprobs_num", 0)
    if k:
        values, ids = full.topk(k, dim=-1)
        meta["input_top_logprobs"] = [None] + [
            [[v, i, None] for v, i in zip(vs, is_)] for vs, is_ in zip(values.tolist(),
                                                                         ids.tolist())]
    asked = body.get("token_ids_logprob_positions")
    if asked is None and "token_ids_logprob" in body:
        asked = [body["token_ids_logprob"]] * len(tokens)
    if asked is not None:
        meta["input_token_ids_logprobs"] = [None] + [
            [[float(full[j, i]), i, None] for i in asked[j + 1]] for j in range(len(full))]
    return meta


@contextmanager
def sglang_teacher(model_dir: str | Path, *, fail_first: int = 0):
    """``(url, requests)`` of a running stand-in server for the model in ``model_dir``."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    requests: list[dict] = []
    lock = threading.Lock()
    failures = [fail_first]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                requests.append(body)
                fail = failures[0] > 0
                failures[0] -= fail
                meta = None if fail else _meta(model, body)
            if fail:
                self.send_response(503)
                self.end_headers()
                return
            reply = json.dumps({"text": "", "meta_info": meta}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/generate", requests
    finally:
        httpd.shutdown()
        httpd.server_close()
