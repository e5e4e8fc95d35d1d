"""The OpenAI chat API beside the page: ``POST /v1/chat/completions`` (whole, or streamed as
server-sent events) and ``GET /v1/models``, served by the page's own server, on its port, from the
model it has loaded. Editors, agent frameworks and scripts speak this API; Medusa makes it faster.

Requests go through ``ChatEngine.answer`` like a browser tab's: they wait in the same line for the
model, one generation at a time, first come first served. Each request has a fresh ``Session`` (its
own Stop) over the API's own KV caches, so a tab's cached conversation is never rewound by a request. A
client that goes away sets the request's cancel flag, and the generation stops at the next step
and leaves the queue. Nothing here reads or writes files.

openai_request.py reads and checks a request; every refusal, there or here, is an ``ApiError``:
OpenAI-shaped, with one line that names the value and the fix.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import platform
import threading
import time
import traceback
import uuid
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import torch
import transformers
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from medusa_core.errors import first_line
from medusa_core.loading.chat_format import json_value

from .engine import BASELINE, MEDUSA, STOP_HINT, ChatEngine, Update
from .models import ModelSlot
from .openai_request import ApiError, ChatRequest, capped_body, parse_chat, prompt_for, read_body
from .session import Session

API_KEY_ENV = "MEDUSA_CHAT_API_KEY"
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
# The longest a stream stays silent. Reading a long prompt on the CPU sends no token for tens of seconds,
# and a client or proxy with a short read timeout would give up; an SSE comment every 2 s keeps it
# (and writing one is what reveals a client that has gone, so the read stops early).
HEARTBEAT_S = 2.0
LOADING_RETRY_S = 10       # Retry-After while a model loads: the openai client's 2 retries then span 20 s
DISCONNECT_POLL_S = 0.25   # how often a whole (not streamed) answer looks whether its client is still there


# ---------------------------------------------------------------- a request read

def accepted(body: bytes, engine: ChatEngine) -> tuple[ChatRequest, list[int]]:
    """The request and its prompt's token ids, or an ApiError. Run on a worker thread, not the event loop:
    a tree named in the request and not yet built is built on the model thread, behind a step or a prompt
    piece that can take seconds on a CPU, and the whole server (page streams, Stop, other requests) froze
    meanwhile."""
    chat = parse_chat(read_body(body), engine, model_id(engine))
    ids, chat = prompt_for(engine, chat)
    return chat, ids


# ---------------------------------------------------------------- answering

class StopText:
    """Cuts the reply at the first stop string, and holds back a tail that might begin one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.sent = 0
        self.stopped = False

    def release(self, text: str, final: bool) -> str:
        """The part of ``text`` (the whole reply so far) that may be sent now."""
        end = len(text)
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0 and at < end:
                end, self.stopped = at, True
        if not self.stopped and not final:
            for stop in self.stops:   # a tail that is the start of a stop string waits for more text
                for k in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:k]):
                        end = min(end, len(text) - k)
                        break
        piece = text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return piece


def generate_updates(engine: ChatEngine, session: Session, prompt: list[int], request: ChatRequest,
                     emit: Callable[[object], None]) -> None:
    """Run the request in this (worker) thread, handing each Update to ``emit``; a final None."""
    try:
        for update in engine.answer(session, prompt, request.settings, request.passes):
            emit(update)
    except Exception as err:     # a thread boundary: the client must hear of it, not wait forever
        traceback.print_exc()    # and the console keeps the whole of it for a report, as the page's answers do
        emit(Update(error=f"generation failed: {type(err).__name__}: {first_line(err, 200)}", done=True))
    finally:
        emit(None)


class Completion:
    """One request's run: its worker thread, its cancel flag and what it has produced so far."""

    def __init__(self, engine: ChatEngine, prompt: list[int], request: ChatRequest, model_id: str,
                 caches: weakref.WeakKeyDictionary | None = None) -> None:
        self.engine, self.prompt, self.request, self.model_id = engine, prompt, request, model_id
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.session = Session(caches)      # its own Stop; ``caches``: the API's, which every request decodes in
        self.stop = StopText(request.stop)
        self.last: Update | None = None
        self._fingerprint: str | None = None
        self.waiting = "starting"      # what a heartbeat says while no text comes: queued, reading the prompt
        self.started = time.perf_counter()
        self._queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        emit = lambda item: loop.call_soon_threadsafe(self._queue.put_nowait, item)  # noqa: E731
        threading.Thread(target=generate_updates, args=(engine, self.session, prompt, request, emit),
                         name="api-request", daemon=True).start()

    def cancel(self) -> None:
        """The client is gone: the generation stops at its next step (or leaves the queue) and frees it."""
        self.session.cancel.set()

    async def pieces(self) -> AsyncIterator[str]:
        """Text as it may be sent, "" for a heartbeat (queued, or nothing new for HEARTBEAT_S); ends with
        the run (ApiError for an error before any token)."""
        beat = time.monotonic()
        while True:
            try:
                update = await asyncio.wait_for(self._queue.get(), HEARTBEAT_S)
            except asyncio.TimeoutError:    # TimeoutError itself from 3.11; another class on 3.10 (review)
                beat = time.monotonic()
                yield ""          # nothing new for a while (a long prompt being read): a heartbeat
                continue
            if update is None:
                return
            if update.queued:
                waiting, self.waiting = self.waiting, f"waiting for the model, {update.queued} ahead"
                # a heartbeat when the place changes, else every HEARTBEAT_S (the queue reports every 0.25 s):
                # it tells the place and reveals a gone client
                if self.waiting != waiting or time.monotonic() - beat >= HEARTBEAT_S:
                    beat = time.monotonic()
                    yield ""
                continue
            if update.notice:
                # one line (an SSE comment ends at a line break), and no page button named
                self.waiting = " ".join(update.notice.replace(STOP_HINT, "").split())
                continue
            if update.pass_name not in (MEDUSA, BASELINE):
                continue
            if update.error and not update.tokens:
                raise ApiError(503 if "stopped" in update.error else 500, update.error, kind="server_error",
                               code="generation_failed")
            if self.stop.stopped:  # the steps still running when the stop string came: their text is not sent,
                continue           # nor counted in usage
            self.last, self.waiting = update, "generating"
            piece = self.stop.release(update.plain, final=update.done)
            if self.stop.stopped:
                self.cancel()     # the rest of the reply is not wanted: free the model now
            if piece:
                yield piece
            if update.error:      # after some text (the model unloaded, out of memory): not a normal "stop"
                raise ApiError(503, update.error, kind="server_error", code="generation_failed")

    def finish_reason(self) -> str:
        if self.stop.stopped:
            return "stop"
        reason = self.last.stats.finish_reason if self.last is not None else None
        return FINISH.get(reason or "", "stop")

    def usage(self) -> dict:
        tokens = list(self.last.tokens) if self.last is not None else []
        if tokens and tokens[-1] in self.engine.loaded.stop_ids:
            tokens = tokens[:-1]          # the end-of-turn token ends the reply; it is not part of it
        if self.stop.stopped:
            # up to the token that completed the stop string, as OpenAI counts: one step accepts several tokens,
            # and it may have accepted some past the stop
            decode = lambda ids: self.engine.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
            while len(tokens) > 1 and any(stop in decode(tokens[:-1]) for stop in self.request.stop):
                tokens = tokens[:-1]
        return {"prompt_tokens": len(self.prompt), "completion_tokens": len(tokens),
                "total_tokens": len(self.prompt) + len(tokens)}

    def medusa(self) -> dict:
        """What Medusa did: the tree, tokens per step, speed."""
        stats = self.last.stats if self.last is not None else None
        if stats is None:
            return {}
        settings = self.request.settings   # the mode that ran: sampling at temperature 0 is greedy
        return {"decoder": stats.label, "mode": "greedy" if settings.greedy else settings.mode,
                "seed": settings.seed,      # what a sampled answer drew with (one drawn for it too): to run it again
                "tree": stats.tree, "tree_size": stats.tree_size,
                # None without a decoding step: a one-token answer has no speed, not a speed of 0
                "tokens_per_step": round(stats.tokens_per_step, 3) if stats.steps else None,
                "tokens_per_second": round(stats.tokens_per_second, 2) if stats.steps else None,
                "time_to_first_token": round(stats.ttft, 4) if stats.ttft is not None else None}

    def fingerprint(self) -> str | None:
        """OpenAI's ``system_fingerprint``: what an answer depends on besides the request, hashed, so a client can
        tell when the same seed may no longer give the same answer (QA: a restart tuned the tree from 4 nodes to
        2, and seed 42 sampled another answer with nothing in the response to say so). The backbone and heads, their
        weights' format and the compute dtype; the kernels the load routed them to (the classes of the model's and
        the heads' modules, and its attention); the machine (the GPU's name, or the CPU's kernels: an AVX2 CPU
        rounds otherwise); torch's and transformers' versions; and the paths of the tree that ran. Not the tiles a
        GPU's tuners chose, which a start that times them again may choose otherwise. None until the first token
        says which tree ran; then made once."""
        stats = self.last.stats if self.last is not None else None
        if self._fingerprint is None and stats is not None and stats.tree:
            engine = self.engine
            machine = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else \
                f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}"
            modules = [*engine.model.modules(), *(engine.heads.modules() if engine.heads is not None else ())]
            routing = (sorted(Counter(type(m).__name__ for m in modules).items()),
                       getattr(engine.model.config, "_attn_implementation", None))
            parts = (engine.loaded.source, engine.weights, str(engine.dtype), routing, machine, torch.__version__,
                     transformers.__version__, stats.tree if stats.tree_size <= 1 else engine.trees.paths(stats.tree))
            self._fingerprint = "fp_" + hashlib.sha256(repr(parts).encode()).hexdigest()[:12]
        return self._fingerprint

    def chunk(self, delta: dict, finish: str | None = None, **extra) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model_id,
                "system_fingerprint": self.fingerprint(),
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
        if self.request.include_usage:   # the spec: every chunk carries "usage", null until the last one's
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"


async def stream_events(run: Completion) -> AsyncIterator[str]:
    try:
        yield run.chunk({"role": "assistant", "content": ""})
        try:
            async for piece in run.pieces():
                # an SSE comment while waiting (clients skip it); writing it is what reveals a gone client
                yield run.chunk({"content": piece}) if piece else f": {run.waiting}\n\n"
        except ApiError as err:
            yield f"data: {json.dumps(err.body())}\n\n"
            return
        yield run.chunk({}, run.finish_reason(), medusa=run.medusa())
        if run.request.include_usage:
            body = {"id": run.id, "object": "chat.completion.chunk", "created": run.created, "model": run.model_id,
                    "system_fingerprint": run.fingerprint(), "choices": [], "usage": run.usage()}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        run.cancel()    # a client that went away mid-stream lands here (the task is cancelled)


async def whole_answer(run: Completion, request: Request) -> JSONResponse:
    async def watch() -> None:
        """A client gone before its whole answer (a timeout, a retry) stops the generation at its next step.
        Polled on its own clock: checked only between pieces slower than the poll, a fast answer never was,
        and an abandoned request held the line for its whole max_tokens."""
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        run.cancel()

    watcher = asyncio.ensure_future(watch())
    text = []
    try:
        async for piece in run.pieces():
            text.append(piece)
    except ApiError as err:
        return err.response()
    finally:
        watcher.cancel()
        run.cancel()
    return JSONResponse({
        "id": run.id, "object": "chat.completion", "created": run.created, "model": run.model_id,
        "system_fingerprint": run.fingerprint(),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                     "finish_reason": run.finish_reason()}],
        "usage": run.usage(), "medusa": run.medusa()})


# ---------------------------------------------------------------- the routes

def model_id(engine: ChatEngine) -> str:
    """The id clients name: a hub id as it is, a local directory by its folder name."""
    source = str(getattr(engine.model, "name_or_path", "") or "model")
    return Path(source).name if Path(source).is_dir() else source


def model_entry(engine: ChatEngine) -> dict:
    """The loaded model as /v1/models lists it; ``medusa``: which tree runs and why (null: no heads, plain
    decoding)."""
    return {"id": model_id(engine), "object": "model", "created": 0, "owned_by": "medusa-chat",
            "medusa": engine.loaded.tree_note or None}


def loading(state) -> ApiError:
    """A request while a model loads: said at once, with when to ask again (a load takes seconds to minutes:
    the first start converts and tunes)."""
    return ApiError(503, f"the model is loading ({state.line.lstrip('⏳ ')}): retry once it has loaded (GET "
                         "/v1/models lists it then)", kind="server_error", code="model_loading",
                    retry_after_s=LOADING_RETRY_S)


def api_routes(slot: ModelSlot, api_key: str | None = None) -> list[APIRoute]:
    """``/v1/models`` and ``/v1/chat/completions`` over the slot's engine, for FastAPI(routes=...)."""
    # The requests' KV caches, one set for all: requests answer one at a time (the engine's line), and a client
    # sends the whole conversation each turn, whose earlier part is then read from the cache, as a tab's is. A
    # cache per request read it all again (seconds on a CPU) and, on CUDA, captured its step's graph again.
    # Apart from the tabs' caches, which a request never rewinds.
    caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        # the scheme's name is case-insensitive (RFC 9110): "bearer KEY" is the same header
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' with the key "
                                f"the app was started with (--api-key or ${API_KEY_ENV})", kind="authentication_error",
                           code="invalid_api_key")

    def engine_now() -> ChatEngine:
        state = slot.state()     # one snapshot: an Unload between two reads of slot.engine gave None (review)
        if state.phase == "loading":
            raise loading(state)
        if state.engine is None:
            why = state.line.removeprefix("❌ ") if state.phase == "failed" else "no model is loaded: load one in the page"
            raise ApiError(503, why, kind="server_error", code="no_model")
        return state.engine

    async def models(request: Request):
        try:
            authorize(request)
            engine = slot.engine
        except ApiError as err:
            return err.response()
        return JSONResponse({"object": "list", "data": [] if engine is None else [model_entry(engine)]})

    async def one_model(request: Request):
        """GET /v1/models/{id}, which clients (the openai client's models.retrieve) ask to check an id."""
        wanted = request.path_params["model"].removesuffix("/")     # a trailing slash is the same path
        if not wanted:            # /v1/models/: the list
            return await models(request)
        try:
            authorize(request)
            state = slot.state()
            engine = state.engine
            if engine is None and state.phase == "loading":   # not "no such model": a tool checking its id at start
                raise loading(state)                           # would give up on it
            if engine is None or wanted != model_id(engine):
                served = "no model is loaded" if engine is None else \
                    f"use {json.dumps(model_id(engine), ensure_ascii=False)}"    # whole: a cut id reads as another
                raise ApiError(404, f"model {json_value(wanted)} is not served here: {served} (GET /v1/models)",
                               param="model", code="model_not_found")
        except ApiError as err:
            return err.response()
        return JSONResponse(model_entry(engine))

    async def chat_completions(request: Request):
        try:
            authorize(request)
            engine = engine_now()
            body = await capped_body(request)
            chat, prompt = await run_in_threadpool(accepted, body, engine)
        except ApiError as err:
            return err.response()
        run = Completion(engine, prompt, chat, model_id(engine), caches)
        if chat.stream:
            return StreamingResponse(stream_events(run), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await whole_answer(run, request)

    served = {"/v1/models": ("GET", models), "/v1/chat/completions": ("POST", chat_completions)}

    async def elsewhere(request: Request):
        """Any other /v1 request (a client's legacy /v1/completions, a wrong method): an OpenAI-shaped
        error that names what is served, where FastAPI's {"detail": "Not Found"} names nothing."""
        path = request.url.path
        # /v1/models/{id} is served too (GET): another method on it is refused as one (a DELETE said "not served")
        key = "/v1/models" if path.startswith("/v1/models/") and path.rstrip("/") != "/v1/models" else path.rstrip("/")
        try:
            authorize(request)
            if key not in served:
                raise ApiError(404, f"{request.method} {path} is not served here: use POST /v1/chat/completions or "
                                    "GET /v1/models (the legacy /v1/completions is not served)", code="unknown_url")
        except ApiError as err:
            return err.response()
        method, handler = served[key]
        if request.method in allowed(method) and key == path.rstrip("/"):   # a trailing slash: the same endpoint
            return await handler(request)
        refused = ApiError(405, f"{request.method} {path} is not served: use {method} {path.rstrip('/')}",
                           code="method_not_allowed").response()
        refused.headers["Allow"] = ", ".join(allowed(method))
        return refused

    def allowed(method: str) -> list[str]:
        # HTTP's HEAD is a GET without the body (a health check's probe was refused with 405)
        return [method, "HEAD"] if method == "GET" else [method]

    return [*(APIRoute(path, handler, methods=allowed(method)) for path, (method, handler) in served.items()),
            APIRoute("/v1/models/{model:path}", one_model, methods=allowed("GET")),    # a hub id holds a "/"
            # last: only what no route above takes
            APIRoute("/v1/{rest:path}", elsewhere, methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])]

