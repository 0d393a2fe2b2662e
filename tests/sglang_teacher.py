"""A stand-in for an SGLang teacher server (``python -m sglang.launch_server``) on CPU: its
native ``/generate`` with ``return_logprob`` and ``max_new_tokens 0``, as slime's and miles'
on-policy distillation call it, answered by a transformers model in this process.

The reply has SGLang's shape: ``meta_info.input_token_logprobs`` holds one ``[log-prob, token
id, None]`` per input token, the first one's log-prob None (nothing predicts it). Every request
body is recorded in ``requests``; ``fail_first`` requests are answered 503 first (the client
retries them)."""

import http.server
import json
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def teacher_log_probs(model, tokens: list[int]) -> list[float | None]:
    """Each token's log-prob under ``model`` given the tokens before it (None for the first)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    picked = torch.log_softmax(logits[:-1], dim=-1).gather(
        1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return [None, *picked.tolist()]


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
                log_probs = None if fail else teacher_log_probs(model, body["input_ids"])
            if fail:
                self.send_response(503)
                self.end_headers()
                return
            entries = [[lp, t, None] for lp, t in zip(log_probs, body["input_ids"])]
            reply = json.dumps({"text": "", "meta_info": {
                "input_token_logprobs": entries, "prompt_tokens": len(entries),
                "completion_tokens": 0}}).encode()
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
