"""A wire-level stand-in for vLLM's OpenAI server in sleep mode, for the tests of the GPU handoff.

vLLM's CPU build has no sleep mode, so these routes cannot run for real here. The stand-in is started
exactly as vLLM is (`python -m vllm.entrypoints.openai.api_server --port ...`, through a shim package
on PYTHONPATH), by the real `VLLMServer` and its supervisor, and answers what vLLM 0.32 answers, read
from its source (vllm/entrypoints/serve/dev/sleep/api_router.py, dev/rpc/api_router.py,
serve/lora/api_router.py and protocol.py, openai/models/serving.py, v1/engine/core.py):

    POST /sleep?level=0..2&mode=abort|wait|keep  -> {"status": "sleeping", "level": level}
    POST /wake_up?tags=weights&tags=kv_cache     -> {"status": "awake" | "sleeping", "tags": [...] | null}
    GET  /is_sleeping                            -> {"is_sleeping": bool}
    POST /collective_rpc {"method": ...}         -> {"results": [null]}
    POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace} -> 200 text | 400 {"error": ...}
    POST /v1/unload_lora_adapter {lora_name}     -> 200 text
    POST /v1/completions (token-id prompts)      -> choices with token_ids and logprobs
    GET  /health                                 -> 200

and the memory rules of a real one: a wake that names tags leaves the others asleep ("sleeping"
until all are back); after a level-2 sleep the woken weights are garbage until `reload_weights`
(its completions come out as token 0); an adapter load or a reload while the weights sleep fails
(vLLM would write into unmapped memory); completions wait while anything sleeps. Every route but
/health needs the bearer key of $VLLM_API_KEY, as later vLLM releases require.

Every call is appended to $STANDIN_LOG as one JSON line with this process's pid (and one "start"
line with the allocator settings it was given), so a test sees the order across restarts.
`POST /_mark?what=...` (not vLLM's) lets a test put its own events in that order.
$STANDIN_WAKE_DELAY_S delays each /wake_up (a wake that hangs), $STANDIN_COMPLETE_DELAY_S each
completion (a request still running when something else happens).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

TAGS = ("weights", "kv_cache")


class State:
    def __init__(self, log_path: str | None, served_name: str) -> None:
        self.lock = threading.Condition()
        self.asleep: set[str] = set()
        self.weights_valid = True
        self.adapters: dict[str, str] = {}
        self.served_name = served_name
        self.log_path = log_path
        self.wake_delay = float(os.environ.get("STANDIN_WAKE_DELAY_S", "0"))
        self.complete_delay = float(os.environ.get("STANDIN_COMPLETE_DELAY_S", "0"))

    def record(self, entry: dict[str, Any]) -> None:
        if self.log_path:
            with self.lock, open(self.log_path, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "t": time.monotonic(), **entry}) + "\n")


def make_handler(state: State, api_key: str | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # the base class's signature
            pass

        def _send(self, status: int, body: Any = None, text: str | None = None) -> None:
            data = (
                text.encode() if text is not None else json.dumps(body).encode() if body is not None else b""
            )
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if text is not None else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str, type_: str, param: str | None = None) -> None:
            self._send(status, {"error": {"message": message, "type": type_, "param": param, "code": status}})

        def do_GET(self) -> None:
            self._handle("GET")

        def do_POST(self) -> None:
            self._handle("POST")

        def _handle(self, method: str) -> None:
            url = urlparse(self.path)
            query = parse_qs(url.query)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            if url.path != "/health" and api_key and self.headers.get("Authorization") != f"Bearer {api_key}":
                self._send(401, {"error": "Unauthorized"})
                return
            state.record({"method": method, "path": url.path, "query": query, "body": body})
            route = {
                ("GET", "/health"): self._health,
                ("POST", "/sleep"): self._sleep,
                ("POST", "/wake_up"): self._wake_up,
                ("GET", "/is_sleeping"): self._is_sleeping,
                ("POST", "/collective_rpc"): self._collective_rpc,
                ("POST", "/v1/load_lora_adapter"): self._load_lora,
                ("POST", "/v1/unload_lora_adapter"): self._unload_lora,
                ("POST", "/v1/completions"): self._completions,
                ("POST", "/_mark"): lambda q, b: self._send(200, {}),
            }.get((method, url.path))
            if route is None:
                self._send(404, {"detail": "Not Found"})
                return
            route(query, body)

        def _health(self, query: dict[str, list[str]], body: Any) -> None:
            self._send(200)

        def _sleep(self, query: dict[str, list[str]], body: Any) -> None:
            level, mode = query.get("level", ["1"])[0], query.get("mode", ["abort"])[0]
            if not level.isdigit() or not 0 <= int(level) <= 2 or mode not in ("abort", "wait", "keep"):
                # FastAPI's 422 for a query value outside `Query(ge=0, le=2)` / `PauseMode`
                self._send(422, {"detail": [{"loc": ["query", "level" if not level.isdigit() else "mode"]}]})
                return
            with state.lock:
                if int(level) >= 1:
                    state.asleep = set(TAGS)
                    if int(level) == 2:
                        state.weights_valid = False
            self._send(200, {"status": "sleeping", "level": int(level)})

        def _wake_up(self, query: dict[str, list[str]], body: Any) -> None:
            tags = query.get("tags") or None
            if state.wake_delay:
                time.sleep(state.wake_delay)
            with state.lock:
                state.asleep -= set(tags or TAGS)
                fully_awake = not state.asleep
                state.lock.notify_all()
            self._send(200, {"status": "awake" if fully_awake else "sleeping", "tags": tags})

        def _is_sleeping(self, query: dict[str, list[str]], body: Any) -> None:
            self._send(200, {"is_sleeping": bool(state.asleep)})

        def _collective_rpc(self, query: dict[str, list[str]], body: Any) -> None:
            if not isinstance(body, dict) or "method" not in body:
                self._send(400, {"detail": "Missing 'method' in request body"})
                return
            if body["method"] != "reload_weights":
                self._error(500, f"stand-in: no worker method {body['method']!r}", "InternalServerError")
                return
            with state.lock:
                if "weights" in state.asleep:
                    self._error(500, "reload_weights while the weights sleep", "InternalServerError")
                    return
                state.weights_valid = True  # reset_lora_state: vLLM's registry keeps the names
            self._send(200, {"results": [None]})

        def _load_lora(self, query: dict[str, list[str]], body: Any) -> None:
            name, path = body.get("lora_name"), body.get("lora_path")
            if not name or not path:
                self._error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
                return
            with state.lock:
                if not body.get("load_inplace") and name in state.adapters:
                    self._error(
                        400,
                        f"The lora adapter '{name}' has already been loaded. If you want to load the "
                        "adapter in place, set 'load_inplace' to True.",
                        "InvalidUserInput",
                    )
                    return
                if "weights" in state.asleep:
                    self._error(500, "add_lora while the weights sleep", "InternalServerError")
                    return
                state.adapters[name] = path
            self._send(200, text=f"Success: LoRA adapter '{name}' added successfully.")

        def _unload_lora(self, query: dict[str, list[str]], body: Any) -> None:
            with state.lock:
                state.adapters.pop(body.get("lora_name"), None)
            self._send(200, text=f"Success: LoRA adapter '{body.get('lora_name')}' removed successfully.")

        def _completions(self, query: dict[str, list[str]], body: Any) -> None:
            model = body.get("model")
            with state.lock:
                if model != state.served_name and model not in state.adapters:
                    self._error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
                    return
                # a paused scheduler holds requests until every tag is awake
                state.lock.wait_for(lambda: not state.asleep, timeout=60)
                garbage = not state.weights_valid
            time.sleep(state.complete_delay)
            prompt = body["prompt"]
            n, max_tokens = int(body.get("n", 1)), int(body.get("max_tokens", 16))
            choices = []
            for i in range(n):
                # what the "model" samples depends on which weights answer: base, adapter, or garbage
                seed = 0 if garbage else (sum(prompt) + 7 * i + len(model)) % 1000 + 1
                ids = [(seed + k) % 1000 for k in range(max_tokens)]
                choices.append(
                    {
                        "index": i,
                        "text": "",
                        "token_ids": ids,
                        "logprobs": {
                            "tokens": [f"token_id:{t}" for t in ids],
                            "token_logprobs": [-1.0] * len(ids),
                            "top_logprobs": [{f"token_id:{t}": -1.0} for t in ids],
                            "text_offset": [0] * len(ids),
                        },
                        "finish_reason": "length",
                    }
                )
            self._send(
                200, {"id": "cmpl-standin", "object": "text_completion", "model": model, "choices": choices}
            )

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name", default="model")
    args, _ = parser.parse_known_args()
    state = State(os.environ.get("STANDIN_LOG"), args.served_model_name)
    state.record(
        {
            "method": "START",
            "path": "",
            "argv": sys.argv[1:],
            "alloc_conf": {v: os.environ.get(v) for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")},
        }
    )
    server = ThreadingHTTPServer((args.host, args.port), make_handler(state, os.environ.get("VLLM_API_KEY")))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
