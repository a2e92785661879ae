"""A small OpenAI-compatible completions server over ``HFSampler``.

It speaks the subset of vLLM's ``/v1/completions`` protocol that ``OpenAISampler`` uses, so the
rollout engine talks to this server on a laptop exactly as it talks to ``vllm serve`` on a GPU
node, and the tests can check the client against a real HTTP round trip:

* request: ``model``, ``prompt`` (a string, a list of token ids, or a list of such lists),
  ``max_tokens``, ``temperature``, ``seed``, ``stop_token_ids``, ``logprobs`` (any integer
  returns the sampled token's log-prob; top alternatives are not computed), and vLLM's
  ``return_token_ids`` / ``return_tokens_as_token_ids``.
* response: one choice per prompt with ``text``, ``finish_reason`` ("stop" | "length"),
  ``stop_reason`` (the stop id, or null), ``logprobs`` {``tokens``, ``token_logprobs``,
  ``top_logprobs``, ``text_offset``}, and with ``return_token_ids`` also ``token_ids`` and
  ``prompt_token_ids``; plus ``usage``.

The log-probs are HFSampler's processed ones (``log_softmax(z / tau)``), which is what vLLM
returns when started with ``--logprobs-mode processed_logprobs``. The tokenizer's
``<|im_end|>`` / eos id is always a stop id, as in vLLM (unless ``ignore_eos``).

One generation runs at a time (a lock): the rollout engine already sends every live
episode's prompt in one request, which HFSampler decodes as one batch.

Run::

    minirsi serve --model runs/toy/base --port 8000
    minirsi rollout --model runs/toy/base --server http://127.0.0.1:8000 --tasks ... --out ...
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from minirsi.sampler import FINISH_STOP, HFSampler

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request body the server cannot serve; answered with HTTP 400 and the message."""


class CompletionServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` holding the sampler; ``serve_forever()`` runs it."""

    daemon_threads = True

    def __init__(self, sampler: HFSampler, tokenizer: Any, model_name: str, host: str = "127.0.0.1", port: int = 8000):
        super().__init__((host, port), _Handler)
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.lock = threading.Lock()
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids = [int(eos)] if eos is not None else []

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """Answer one ``/v1/completions`` body (a dict) with a response dict."""
        prompts = self._prompts(body.get("prompt"))
        max_tokens = _int(body, "max_tokens", 16)
        temperature = float(body.get("temperature", 1.0))
        seed = body.get("seed")
        n = _int(body, "n", 1)
        if n != 1:
            raise RequestError(f"n={n}: this server returns one completion per prompt; send n=1")
        if body.get("stream"):
            raise RequestError("stream=true is not supported; send stream=false")
        stop_ids = [int(t) for t in body.get("stop_token_ids") or []]
        if not body.get("ignore_eos", False):
            stop_ids += self.eos_ids
        want_logprobs = body.get("logprobs") is not None
        as_ids = bool(body.get("return_tokens_as_token_ids", False))
        skip_special = bool(body.get("skip_special_tokens", True))
        with self.lock:
            samples = self.sampler.generate(prompts, max_tokens, temperature, stop_ids, seed=seed)
        choices = []
        for i, (prompt, s) in enumerate(zip(prompts, samples)):
            ids = list(s.token_ids)
            stopped = s.finish_reason == FINISH_STOP
            # vLLM's text leaves out the stop token unless include_stop_str_in_output.
            text_ids = ids if (not stopped or body.get("include_stop_str_in_output")) else ids[:-1]
            choice: dict[str, Any] = {
                "index": i,
                "text": self.tokenizer.decode(text_ids, skip_special_tokens=skip_special),
                "finish_reason": s.finish_reason,
                "stop_reason": ids[-1] if stopped else None,
                "logprobs": None,
            }
            if want_logprobs:
                pieces = [f"token_id:{t}" if as_ids else self.tokenizer.decode([t]) for t in ids]
                offsets, pos = [], 0
                for p in pieces:
                    offsets.append(pos)
                    pos += len(p)
                choice["logprobs"] = {
                    "tokens": pieces,
                    "token_logprobs": list(s.logprobs),
                    "top_logprobs": [{p: lp} for p, lp in zip(pieces, s.logprobs)],
                    "text_offset": offsets,
                }
            if body.get("return_token_ids"):
                choice["token_ids"] = ids
                choice["prompt_token_ids"] = list(prompt)
            choices.append(choice)
        n_prompt = sum(map(len, prompts))
        n_out = sum(len(s.token_ids) for s in samples)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out},
        }

    def _prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt, add_special_tokens=False)]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(t, int) for t in prompt):
                return [prompt]
            out = []
            for p in prompt:
                if isinstance(p, str):
                    out.append(self.tokenizer.encode(p, add_special_tokens=False))
                elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
                    out.append(p)
                else:
                    raise RequestError("each prompt must be a string or a non-empty list of token ids")
            return out
        raise RequestError("'prompt' must be a string, a list of token ids, or a list of those")


def _int(body: dict[str, Any], key: str, default: int) -> int:
    v = body.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise RequestError(f"'{key}'={v!r}: must be a positive integer")
    return v


class _Handler(BaseHTTPRequestHandler):
    server: CompletionServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # route http.server's log to logging
        logger.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": {"message": message, "type": "invalid_request_error", "code": status}})

    def do_GET(self) -> None:
        if self.path in ("/health", "/v1/health"):
            self._send(200, {"status": "ok"})
        elif self.path == "/v1/models":
            card = {"id": self.server.model_name, "object": "model", "owned_by": "minirsi"}
            self._send(200, {"object": "list", "data": [card]})
        else:
            self._error(404, f"no route {self.path}; use POST /v1/completions")

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self._error(404, f"no route {self.path}; use POST /v1/completions")
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object")
            self._send(200, self.server.complete(body))
        except (RequestError, json.JSONDecodeError, ValueError) as e:
            self._error(400, str(e))
        except Exception as e:  # a generation crash must answer 500, not drop the connection
            logger.exception("completion failed")
            self._error(500, f"{type(e).__name__}: {e}")


def start_in_thread(server: CompletionServer) -> threading.Thread:
    """Run ``server`` in a daemon thread (tests, notebooks); stop with ``server.shutdown()``."""
    t = threading.Thread(target=server.serve_forever, name="minirsi-serve", daemon=True)
    t.start()
    return t


def cli(argv: list[str] | None = None, command: str = "serve") -> int:
    parser = argparse.ArgumentParser(prog=f"minirsi {command}", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="model directory or Hugging Face name")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    parser.add_argument("--served-model-name", default=None, help="name clients send (default: --model)")
    parser.add_argument("--max-batch-size", type=int, default=None, help="decode at most this many prompts at once")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from minirsi.models import load_actor

    model, tokenizer = load_actor(args.model, device=args.device)
    server = CompletionServer(
        HFSampler(model, tokenizer, max_batch_size=args.max_batch_size),
        tokenizer,
        args.served_model_name or args.model,
        args.host,
        args.port,
    )
    print(f"minirsi serve: {server.url}/v1/completions (model {server.model_name})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
