"""A small OpenAI-compatible completions server over ``HFSampler``.

It speaks the subset of vLLM's ``/v1/completions`` protocol that ``OpenAISampler`` uses, so the
rollout engine talks to this server on a laptop exactly as it talks to ``vllm serve`` on a GPU
node, and the tests can check the client against a real HTTP round trip:

* request: ``model``, ``prompt`` (a string, a list of token ids, or a list of such lists),
  ``max_tokens``, ``temperature``, ``seed``, ``stop_token_ids``, ``ignore_eos``, ``logprobs``
  (any integer returns the sampled token's log-prob; top alternatives are not computed), and
  vLLM's ``return_token_ids`` / ``return_tokens_as_token_ids``. The other sampling fields
  (``top_p``, ``top_k``, ``min_p``, the penalties) are accepted at their neutral values only
  (the full distribution, as HFSampler samples it); any other value is a 400.
* response: one choice per prompt with ``text``, ``finish_reason`` ("stop" | "length"),
  ``stop_reason`` (the stop id, or null), ``logprobs`` {``tokens``, ``token_logprobs``,
  ``top_logprobs``, ``text_offset``}, and with ``return_token_ids`` also ``token_ids`` and
  ``prompt_token_ids``; plus ``usage``.

The log-probs are HFSampler's processed ones (``log_softmax(z / tau)``), which is what vLLM
returns when started with ``--logprobs-mode processed_logprobs``. The tokenizer's
``<|im_end|>`` / eos id is always a stop id, as in vLLM (unless ``ignore_eos``).

One generation runs at a time (a lock): the rollout engine already sends every live
episode's prompt in one request, which HFSampler decodes as one batch.

Weight sync (``minirsi.engine.weight_sync``): the same routes a ``vllm serve`` with minirsi's worker
extension (``scale/serving/vllm_worker_ext.py``) and ``VLLM_SERVER_DEV_MODE=1`` answers, so the
trainer's side of the protocol is tested here without a GPU. Each waits for the generation in
progress (the lock) and answers only when done:

* ``POST /collective_rpc`` {"method": "minirsi_load_weights", "args": [dir]}: load the
  safetensors that ``weight_sync.write_full_weights`` wrote (every parameter, strictly: a
  missing or extra name is a 400 naming it); also clears the prefix cache.
* ``POST /reset_prefix_cache``: drop the kept KV caches (they belong to the old weights);
  answers ``{"success": true}`` as vLLM 0.33 does.
* ``POST /v1/load_lora_adapter`` {"lora_name", "lora_path"} and ``/v1/unload_lora_adapter``
  {"lora_name"} (with ``--enable-lora``): a peft adapter directory; a request whose ``model`` is
  the adapter's name samples with it, the served name samples the base model, any other name
  is a 404 (as vLLM does).

``prompt_logprobs`` (vLLM's extension, any integer) returns, per prompt, ``None`` then one
``{"<id>": {"logprob": x}}`` per later prompt token: the untempered log pi(x_t | x_<t) of the
prompt itself, which the tests and ``WeightSync(verify_tol=...)`` compare with the trainer's.

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
from contextlib import nullcontext
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from minirsi.engine.models import token_logprobs
from minirsi.engine.sampler import FINISH_STOP, HFSampler
from minirsi.engine.weight_sync import RELOAD_METHOD, read_full_weights

logger = logging.getLogger(__name__)


NEUTRAL_SAMPLING = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0}
"""Sampling fields whose only accepted value is the one that leaves the distribution whole
(``top_k`` 0 means the same as -1 in vLLM)."""


class RequestError(ValueError):
    """A request body the server cannot serve; answered with HTTP 400 and the message."""


class NotFound(RequestError):
    """A model or adapter name the server does not have; answered with HTTP 404."""


class CompletionServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` holding the sampler; ``serve_forever()`` runs it."""

    daemon_threads = True

    def __init__(self, sampler: HFSampler, tokenizer: Any, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                 enable_lora: bool = False):
        super().__init__((host, port), _Handler)
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.enable_lora = enable_lora
        self.adapters: dict[str, str] = {}
        """Loaded LoRA adapters: name -> directory."""
        self.reloads = 0
        """Full-weight reloads done (tests and logs read it)."""
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
        for key, neutral in NEUTRAL_SAMPLING.items():
            if body.get(key) is not None and body[key] != neutral and not (key == "top_k" and body[key] == 0):
                raise RequestError(f"{key}={body[key]!r}: this server samples the full distribution; send {neutral}")
        stop_ids = [int(t) for t in body.get("stop_token_ids") or []]
        if not body.get("ignore_eos", False):
            stop_ids += self.eos_ids
        want_logprobs = body.get("logprobs") is not None
        as_ids = bool(body.get("return_tokens_as_token_ids", False))
        skip_special = bool(body.get("skip_special_tokens", True))
        with self.lock, self._weights_for(body.get("model")):
            samples = self.sampler.generate(prompts, max_tokens, temperature, stop_ids, seed=seed)
            scored = [self._prompt_logprobs(p) for p in prompts] if body.get("prompt_logprobs") is not None else None
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
            if scored is not None:
                choice["prompt_logprobs"] = [None] + [{str(t): {"logprob": lp}} for t, lp in zip(prompt[1:], scored[i])]
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

    # -- weights: which to sample with, reload, LoRA adapters ------------------------------------

    def _weights_for(self, name: Any) -> Any:
        """The context that makes the sampler use the weights ``name`` asks for (lock held)."""
        model = self.sampler.model
        if name in self.adapters:
            model.set_adapter(name)
            return nullcontext()
        if self.enable_lora and name != self.model_name:
            raise NotFound(f"The model `{name}` does not exist: serve {self.model_name!r} or a loaded adapter "
                           f"{sorted(self.adapters)}")
        return model.disable_adapter() if hasattr(model, "disable_adapter") else nullcontext()

    @torch.inference_mode()
    def _prompt_logprobs(self, prompt: list[int]) -> list[float]:
        """Untempered log pi(x_t | x_<t), t = 1 .. len - 1, of one prompt (lock held)."""
        model = self.sampler.model
        ids = torch.tensor([prompt], device=self.sampler.device)
        was_training = model.training
        model.eval()
        try:
            return token_logprobs(model, ids)[0, 1:].tolist()
        finally:
            model.train(was_training)

    def collective_rpc(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's dev-mode ``/collective_rpc``: only the worker extension's ``minirsi_load_weights``."""
        method, args = body.get("method"), body.get("args") or []
        if method != RELOAD_METHOD or len(args) != 1 or not isinstance(args[0], str):
            raise RequestError(f"collective_rpc method={method!r} args={args!r}: this server implements only "
                               f"{RELOAD_METHOD!r} with one argument, the directory to load")
        with self.lock:
            model = self.sampler.model
            if hasattr(model, "peft_config"):
                raise RequestError(f"{RELOAD_METHOD} with LoRA adapters loaded: sync LoRA servers with "
                                   "/v1/load_lora_adapter, or restart the server without --enable-lora")
            try:
                state = read_full_weights(args[0])
            except (OSError, ValueError) as e:
                raise RequestError(f"{RELOAD_METHOD} {args[0]}: {e}") from None
            missing = sorted(set(model.state_dict()) - set(state))
            extra = sorted(set(state) - set(model.state_dict()))
            if missing or extra:
                raise RequestError(f"{RELOAD_METHOD} {args[0]}: missing {missing[:5]}, unexpected {extra[:5]}: "
                                   "not this model's parameters")
            model.load_state_dict(state, strict=True)
            self.sampler.clear_cache()
            self.reloads += 1
        logger.info("reloaded weights from %s (reload %d)", args[0], self.reloads)
        return {"results": [{"reloaded": args[0], "reloads": self.reloads}]}

    def reset_prefix_cache(self) -> dict[str, bool]:
        with self.lock:
            self.sampler.clear_cache()
        return {"success": True}

    def load_lora_adapter(self, body: dict[str, Any]) -> str:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not self.enable_lora:
            raise RequestError("LoRA is not enabled on this server; start it with --enable-lora")
        if not isinstance(name, str) or not name or not isinstance(path, str):
            raise RequestError("load_lora_adapter needs 'lora_name' and 'lora_path' strings")
        with self.lock:
            if name in self.adapters:
                raise RequestError(f"The lora adapter '{name}' has already been loaded; load it under a new name")
            model = self.sampler.model
            try:
                if hasattr(model, "load_adapter") and hasattr(model, "peft_config"):
                    model.load_adapter(path, adapter_name=name)
                else:
                    from peft import PeftModel

                    self.sampler.model = PeftModel.from_pretrained(model, path, adapter_name=name)
            except (OSError, ValueError) as e:
                raise RequestError(f"load_lora_adapter {name} from {path}: {e}") from None
            self.sampler.model.eval()
            self.adapters[name] = path
            self.sampler.clear_cache()
        logger.info("loaded LoRA adapter %s from %s", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora_adapter(self, body: dict[str, Any]) -> str:
        name = body.get("lora_name")
        with self.lock:
            if name not in self.adapters:
                raise NotFound(f"The lora adapter '{name}' cannot be found; loaded: {sorted(self.adapters)}")
            self.sampler.model.delete_adapter(name)
            del self.adapters[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

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
    # TCP_NODELAY: headers and body are two writes, and Nagle held the body for the client's
    # delayed ACK (docs/experiments.md, "Measurements behind the code's defaults").
    disable_nagle_algorithm = True

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
        srv = self.server
        routes = {
            "/v1/completions": srv.complete,
            "/collective_rpc": srv.collective_rpc,
            "/reset_prefix_cache": lambda body: srv.reset_prefix_cache(),
            "/v1/load_lora_adapter": srv.load_lora_adapter,
            "/v1/unload_lora_adapter": srv.unload_lora_adapter,
        }
        path = self.path.split("?", 1)[0]
        if path not in routes:
            self._error(404, f"no route {self.path}; POST one of {sorted(routes)}")
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length) or b"{}") or {}
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object")
            answer = routes[path](body)
            if isinstance(answer, str):  # vLLM answers the LoRA routes with plain text
                data = answer.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            else:
                self._send(200, answer if answer is not None else {})
        except NotFound as e:
            self._error(404, str(e))
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
    parser.add_argument("--enable-lora", action="store_true", help="accept /v1/load_lora_adapter (as vLLM's flag)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from minirsi.engine.models import load_actor

    model, tokenizer = load_actor(args.model, device=args.device)
    server = CompletionServer(
        HFSampler(model, tokenizer, max_batch_size=args.max_batch_size),
        tokenizer,
        args.served_model_name or args.model,
        args.host,
        args.port,
        enable_lora=args.enable_lora,
    )
    print(f"minirsi serve: {server.url}/v1/completions (model {server.model_name})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
