"""``lessmem serve``: an OpenAI-compatible HTTP server over :class:`lessmem.serve.Engine`.

Start it from the command line (all options are checked before the model loads; one
line on stderr says where it listens once it does)::

    $ lessmem serve smollm2-135m --kv best-4 --kv-budget 256MiB --offload host@2GiB,disk:/var/kv
    lessmem serve: smollm2-135m (kv best-4, budget 256MiB, offload host@2GiB,disk:/var/kv) ready at http://127.0.0.1:8000/v1

and talk to it with any OpenAI client::

    >>> from openai import OpenAI                                            # doctest: +SKIP
    >>> client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none") # doctest: +SKIP
    >>> client.completions.create(model="smollm2-135m", prompt="The sky is", max_tokens=8)  # doctest: +SKIP

Routes:

- ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the prompt of a chat is
  built by the tokenizer's chat template; a tokenizer without one is a 400). Parameters:
  ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature`` (0 = greedy),
  ``top_p``, ``stop`` (a string or a list of them), ``seed``, ``n`` (1 only), ``stream``
  with ``stream_options.include_usage``; the vLLM-style extras ``ignore_eos`` and
  ``stop_token_ids`` too. A completion's ``prompt`` is a string, a list of token ids, or
  a list holding one of those. ``usage`` has ``prompt_tokens``, ``completion_tokens``,
  ``total_tokens`` and ``prompt_tokens_details.cached_tokens`` (prompt tokens whose KV
  came from the prefix cache).
- Streaming is Server-Sent Events: ``data: {chunk}\\n\\n`` per new piece of text, then
  a chunk with ``finish_reason``, the usage chunk when asked, and ``data: [DONE]``. A
  client that goes away mid-stream (or mid-request) aborts its request in the engine,
  which frees its KV blocks.
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format:
  :mod:`lessmem.serve.metrics` lists the series).
- Bad input — malformed JSON, an unknown model, a wrong type, ``max_tokens <= 0``, a
  prompt that with ``max_tokens`` exceeds the model's context, an unsupported parameter
  — is answered with a 4xx and OpenAI's error body ``{"error": {"message", "type",
  "param", "code"}}`` before anything is queued; the server keeps serving.

How it works: the engine steps in a thread of its own, apart from the event loop:
``lessmem serve`` steps it on the main thread (the one the model was loaded on, see
``Engine.start``) and runs this app on another (``owns_engine=False``); with the
default ``owns_engine=True`` the app's lifespan starts the engine's thread. Each request
gets an ``asyncio.Queue``; the engine calls the request's listener from its thread and
the listener hands each :class:`TokenEvent` to the event loop with
``loop.call_soon_threadsafe`` (the pattern of vLLM's ``AsyncLLMEngine`` output queues,
written here for lessmem's engine).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lessmem.serve import SamplingParams
from lessmem.serve.metrics import CONTENT_TYPE, ServeMetrics

MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 512  # characters per stop string


class ApiError(Exception):
    """A request the server refuses, answered as ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.type)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type_: str = "invalid_request_error") -> JSONResponse:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


# ----------------------------------------------------------------------------- parsing

def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def parse_body(raw: bytes) -> dict:
    """The request body as a dict; ApiError 400 for anything but a JSON object."""
    if not raw.strip():
        raise ApiError(400, "the request body is empty; allowed: a JSON object")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not UTF-8 text; allowed: a JSON object") from None
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise ApiError(400, f"the request body is not valid JSON ({exc}); allowed: a JSON object") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body is a JSON {type(body).__name__}; allowed: a JSON object")
    return body


def _type_name(v) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(v), type(v).__name__)


def _bad(param: str, value, allowed: str) -> ApiError:
    shown = json.dumps(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return ApiError(400, f"{param}={shown}: allowed: {allowed}", param=param)


def _int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)  # JSON writers often send 16.0
        else:
            raise _bad(name, v, f"an integer{_range(lo, hi)} (got a {_type_name(v)})")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _bad(name, v, f"an integer{_range(lo, hi)}")
    return v


def _range(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    return f" >= {lo}" if lo is not None else (f" <= {hi}" if hi is not None else "")


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    allowed = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(name, v, f"{allowed} (got a {_type_name(v)})")
    v = float(v)
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        raise _bad(name, v, allowed)
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, v, f"true or false (got a {_type_name(v)})")
    return v


def _stop(body: dict) -> list[str] | None:
    v = body.get("stop")
    if v is None:
        return None
    allowed = f"a non-empty string or a list of at most {MAX_STOP} of them, each at most {MAX_STOP_CHARS} characters"
    items = [v] if isinstance(v, str) else v
    if (not isinstance(items, list) or len(items) > MAX_STOP
            or any(not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS for s in items)):
        raise _bad("stop", v, allowed)
    return list(items) or None


def _token_ids(name: str, v, vocab: int) -> list[int]:
    if (not isinstance(v, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in v)):
        raise _bad(name, v, "a list of integer token ids")
    bad = [t for t in v if not 0 <= t < vocab]
    if bad:
        raise _bad(name, bad[:4], f"token ids in [0, {vocab - 1}] (the tokenizer's vocabulary)")
    return list(v)


# parameters of OpenAI's API this server does not implement: allowed only at their "off" value
_OFF = {
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "logprobs": (None, False, 0),
    "top_logprobs": (None, 0), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "logit_bias": (None,), "tools": (None,), "tool_choice": (None, "none"), "functions": (None,),
    "function_call": (None, "none"), "parallel_tool_calls": (None, False, True), "top_k": (None, -1, 0),
    "response_format": (None,), "modalities": (None,), "audio": (None,), "prediction": (None,),
}
_EMPTY_OK = {"logit_bias", "tools", "functions"}  # {} / [] mean "none" too
_IGNORED = {"user", "store", "metadata", "service_tier", "reasoning_effort", "stream_options", "stream",
            "model", "n"}  # accepted; the ones that matter are read where they are used
_COMMON = {"max_tokens", "temperature", "top_p", "stop", "seed", "ignore_eos", "stop_token_ids"}
_FIELDS = {"completions": _COMMON | {"prompt"},
           "chat": _COMMON | {"messages", "max_completion_tokens"}}


def _same(v, off) -> bool:
    """``v`` is the "off" value ``off`` (0 and 0.0 alike; true is not 1)."""
    if off is None or isinstance(off, bool):
        return v is off
    if isinstance(off, int):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v == off
    return v == off


def _check_fields(body: dict, kind: str) -> None:
    known = _FIELDS[kind] | _IGNORED | set(_OFF)
    for k in body:
        if k not in known:
            raise ApiError(400, f"unrecognized request argument {k!r}; allowed: "
                           f"{', '.join(sorted(_FIELDS[kind] | {'model', 'n', 'stream', 'stream_options', 'user'}))}",
                           param=k)
    for k, off in _OFF.items():
        v = body.get(k)
        if k == "response_format" and isinstance(v, dict) and v == {"type": "text"}:
            continue
        if k in _EMPTY_OK and v in ({}, []):
            continue
        if not any(_same(v, o) for o in off):
            raise _bad(k, v, f"{' or '.join(json.dumps(o) for o in off)} "
                       "(lessmem serve does not implement this parameter)")


# ----------------------------------------------------------------------------- the app

class _Pending:
    """One submitted request: its queue of TokenEvents on the event loop's side."""

    def __init__(self, loop: asyncio.AbstractEventLoop, metrics: ServeMetrics, rid: str, t0: float):
        self.loop, self.metrics, self.id, self.t0 = loop, metrics, rid, t0
        self.queue: asyncio.Queue = asyncio.Queue()
        self.req = None  # the engine's Request, set right after submit returns
        self.finished = False

    def listener(self, ev) -> None:
        """Called from the engine's thread: hand the event to the loop (never raise there)."""
        try:
            self.loop.call_soon_threadsafe(self._on_loop, ev)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    def _on_loop(self, ev) -> None:
        # runs on the loop, after submit() returned (the handler holds the loop until then)
        if ev.finished and not self.finished:
            self.finished = True
            self.metrics.observe_finished(self.stats(), time.perf_counter() - self.t0)
        self.queue.put_nowait(ev)

    def stats(self) -> dict:
        return dict(getattr(self.req, "stats", None) or {})


def create_app(engine, tok, *, owns_engine: bool = True, describe: str | None = None) -> FastAPI:
    """The ASGI app serving ``engine`` (a :class:`lessmem.serve.Engine`) with tokenizer ``tok``.

    With ``owns_engine`` the app's lifespan starts the engine's thread and closes the
    engine at shutdown. ``describe`` is shown by ``/health`` (the cache config in words).
    """
    model_name = engine.model_name
    metrics = ServeMetrics(engine)
    created = int(time.time())
    vocab = len(tok)

    @asynccontextmanager
    async def lifespan(app):
        if owns_engine:
            engine.start()
        try:
            yield
        finally:
            if owns_engine:
                await asyncio.get_running_loop().run_in_executor(None, engine.close)

    app = FastAPI(title="lessmem serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.metrics = engine, metrics

    # ---------------------------------------------------------------- errors, all in OpenAI's shape
    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        metrics.rejected(exc.status)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        metrics.rejected(exc.status_code)
        routes = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, /health, /metrics"
        msg = {404: f"no route {request.method} {request.url.path}; allowed: {routes}",
               405: f"method {request.method} not allowed on {request.url.path}; allowed: {routes}"}
        return error_response(exc.status_code, msg.get(exc.status_code, str(exc.detail)),
                              code=str(exc.status_code) if exc.status_code in msg else None,
                              type_="invalid_request_error" if exc.status_code < 500 else "server_error")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        metrics.rejected(400)
        return error_response(400, str(exc))

    @app.exception_handler(Exception)
    async def _server_error(request, exc: Exception):
        metrics.rejected(500)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error")

    # ---------------------------------------------------------------- plain routes
    @app.get("/health")
    async def health():
        m = engine.metrics()
        return {"status": "ok", "model": model_name, "config": describe,
                "running": m["running"], "waiting": m["waiting"], "swapped": m["swapped"]}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "lessmem", "max_model_len": engine.max_context}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    # ---------------------------------------------------------------- the two generation routes
    def common(body: dict, kind: str, n_prompt: int, prompt_param: str) -> tuple[SamplingParams, dict]:
        """SamplingParams and the stream options from a checked body."""
        n = body.get("n")
        if n is not None and (isinstance(n, bool) or n != 1):
            raise _bad("n", n, "1 (one choice per request; send several requests for more: "
                       "the engine batches them)")
        stream = _bool(body, "stream", False)
        so = body.get("stream_options")
        include_usage = False
        if so is not None:
            if not stream:
                raise _bad("stream_options", so, "null unless stream is true")
            if not isinstance(so, dict) or set(so) - {"include_usage"}:
                raise _bad("stream_options", so, 'an object such as {"include_usage": true}')
            include_usage = _bool(so, "include_usage", False)
        room = engine.max_context - n_prompt
        mt_name = "max_tokens"
        if kind == "chat" and body.get("max_completion_tokens") is not None:
            if body.get("max_tokens") is not None:
                raise _bad("max_completion_tokens", body["max_completion_tokens"],
                           "null when max_tokens is given (they are the same limit)")
            mt_name = "max_completion_tokens"
        default = 16 if kind == "completions" else max(room, 1)
        max_tokens = _int(body, mt_name, default, 1)
        if n_prompt + max_tokens > engine.max_context:
            raise ApiError(400, f"this model's context is {engine.max_context:,} tokens, but the {prompt_param} "
                           f"has {n_prompt:,} tokens and {mt_name} is {max_tokens:,} ({n_prompt + max_tokens:,} "
                           f"in all); allowed: a shorter {prompt_param} or {mt_name} <= {max(room, 0):,}",
                           param=mt_name if room > 0 else prompt_param, code="context_length_exceeded")
        stop_ids = body.get("stop_token_ids")
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
            stop=_stop(body),
            seed=_int(body, "seed", None, 0, 2**63 - 1),
            stop_token_ids=None if stop_ids is None else _token_ids("stop_token_ids", stop_ids, vocab),
            ignore_eos=_bool(body, "ignore_eos", False),
        )
        return params, {"stream": stream, "include_usage": include_usage}

    def completion_prompt(body: dict) -> list[int]:
        p = body.get("prompt")
        if p is None:
            raise ApiError(400, "prompt is required; allowed: a string or a list of token ids", param="prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if not p:
                raise _bad("prompt", p, "a non-empty string or list of token ids")
            return list(tok(p)["input_ids"])
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            raise ApiError(400, f"prompt holds {len(p)} prompts; allowed: one prompt per request "
                           "(send them as separate requests: they are batched by the engine)", param="prompt")
        ids = _token_ids("prompt", p, vocab)
        if not ids:
            raise _bad("prompt", p, "a non-empty string or list of token ids")
        return ids

    def chat_prompt(body: dict) -> list[int]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _bad("messages", msgs, 'a non-empty list of {"role": ..., "content": ...} objects')
        clean = []
        for i, m in enumerate(msgs):
            param = f"messages[{i}]"
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad(param, m, 'an object {"role": "system"|"user"|"assistant", "content": "..."}')
            if m["role"] not in ("system", "developer", "user", "assistant"):
                raise _bad(f"{param}.role", m["role"], "system, developer, user or assistant")
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": "..."}]
                if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                           for c in content):
                    raise _bad(f"{param}.content", content, 'a string or a list of {"type": "text", "text": "..."} '
                               "parts (this server serves text only)")
                content = "".join(c["text"] for c in content)
            if not isinstance(content, str):
                raise _bad(f"{param}.content", content, "a string")
            clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
        if not getattr(tok, "chat_template", None):
            raise ApiError(400, f"the model {model_name!r} has no chat template (its tokenizer defines none); "
                           "allowed: POST /v1/completions with a plain prompt", param="messages",
                           code="no_chat_template")
        try:
            text = tok.apply_chat_template(clean, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template's own checks (jinja raise_exception), e.g. role order
            raise ApiError(400, f"the chat template refused these messages: {exc}", param="messages") from None
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def submit(prompt_ids: list[int], params: SamplingParams, rid: str, prompt_param: str) -> _Pending:
        try:
            params.check()
            engine.check_request(prompt_ids, params)
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc), param=prompt_param if "prompt" in str(exc) else None) from None
        pending = _Pending(asyncio.get_running_loop(), metrics, rid, time.perf_counter())
        try:
            pending.req = engine.submit(prompt_ids, params, listener=pending.listener, request_id=rid)
        except RuntimeError as exc:  # the engine is stopping or has stopped
            raise ApiError(503, f"the engine is not running ({exc}); try again later",
                           type_="server_error", code="engine_stopped") from None
        metrics.accepted()
        return pending

    def check_model(body: dict) -> None:
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise _bad("model", name, f"a string: {model_name!r}")
        if name is not None and name != model_name:
            raise ApiError(404, f"the model {name!r} does not exist; allowed: {model_name!r} "
                           "(see GET /v1/models)", param="model", code="model_not_found")

    async def handle(request: Request, kind: str):
        body = parse_body(await request.body())
        check_model(body)
        _check_fields(body, kind)
        prompt_param = "prompt" if kind == "completions" else "messages"
        prompt_ids = completion_prompt(body) if kind == "completions" else chat_prompt(body)
        params, opts = common(body, kind, len(prompt_ids), prompt_param)
        rid = ("cmpl-" if kind == "completions" else "chatcmpl-") + uuid.uuid4().hex
        pending = submit(prompt_ids, params, rid, prompt_param)
        shape = _Shape(kind, rid, model_name, len(prompt_ids))
        if opts["stream"]:
            return _EventStream(engine, pending, _sse(pending, shape, opts["include_usage"]))
        return JSONResponse(await _collect(engine, pending, shape, request))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, "chat")

    return app


class _Shape:
    """The JSON objects of one request's answer (completion or chat; whole or chunks)."""

    def __init__(self, kind: str, rid: str, model: str, n_prompt: int):
        self.kind, self.id, self.model, self.n_prompt = kind, rid, model, n_prompt
        self.created = int(time.time())

    def usage(self, pending: _Pending) -> dict:
        st = pending.stats()
        req = pending.req
        out = st.get("output_tokens")
        if out is None:
            out = len(getattr(req, "output_ids", ()) or ())
        return {"prompt_tokens": self.n_prompt, "completion_tokens": int(out),
                "total_tokens": self.n_prompt + int(out),
                "prompt_tokens_details": {"cached_tokens": int(st.get("cached_tokens") or 0)}}

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str | None, usage: dict) -> dict:
        if self.kind == "completions":
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("text_completion"), "choices": [choice], "usage": usage}
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        return {**self._head("chat.completion"), "choices": [choice], "usage": usage}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False,
              with_usage: bool = False) -> dict:
        if self.kind == "completions":
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        else:
            delta = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", "content": text or ""}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        if with_usage:
            out["usage"] = None  # OpenAI: every chunk has usage null, the last one has it filled
        return out

    def usage_chunk(self, usage: dict) -> dict:
        obj = "text_completion" if self.kind == "completions" else "chat.completion.chunk"
        return {**self._head(obj), "choices": [], "usage": usage}


def _data(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _sse(pending: _Pending, shape: _Shape, include_usage: bool):
    """The SSE byte stream of one request."""
    if shape.kind == "chat":
        yield _data(shape.chunk("", first=True, with_usage=include_usage))
    while True:
        ev = await pending.queue.get()
        if ev.text:
            yield _data(shape.chunk(ev.text, with_usage=include_usage))
        if ev.finished:
            yield _data(shape.chunk(None, ev.finish_reason, with_usage=include_usage))
            if include_usage:
                yield _data(shape.usage_chunk(shape.usage(pending)))
            yield b"data: [DONE]\n\n"
            return


class _EventStream(StreamingResponse):
    """``text/event-stream`` of one request that aborts it in the engine however the
    response ends before the request does: the client went away (starlette cancels the
    stream, even before its first byte), a send failed, or the server is shutting down."""

    def __init__(self, engine, pending: _Pending, content):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.engine, self.pending = engine, pending

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.pending.finished:  # its blocks are freed at the engine's next step
                self.engine.abort(self.pending.id)


async def _collect(engine, pending: _Pending, shape: _Shape, request: Request) -> dict:
    """The whole answer of a non-streaming request; a client that disconnects first aborts it."""

    async def watch():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                engine.abort(pending.id)
                return

    watcher = asyncio.create_task(watch())
    parts, reason = [], None
    try:
        while True:
            ev = await pending.queue.get()
            parts.append(ev.text or "")
            if ev.finished:
                reason = ev.finish_reason
                break
    except BaseException:
        engine.abort(pending.id)
        raise
    finally:
        watcher.cancel()
    return shape.whole("".join(parts), reason, shape.usage(pending))


__all__ = ["ApiError", "create_app", "error_response", "parse_body"]
