"""`localllm serve`: OpenAI's, Ollama's and Anthropic's HTTP APIs on localhost (FastAPI + uvicorn).

This module holds the app, the served models (`ModelPool`) and the guard; the routes are in
`server_openai`, `server_ollama` and `server_anthropic`, the wire schema in `server_schema`,
one generation's plumbing in `server_jobs`. Every model step runs on the engine thread
(`server_engine`), which interleaves concurrent requests token by token, each with its own
KV cache.

Security defaults: bind 127.0.0.1; on a loopback bind the Host header must name the loopback
(DNS rebinding) and a browser Origin must be local or listed with --cors-origin (CORS is off
unless origins are listed); bodies are capped; an optional API key is required on every endpoint
but /health; nothing a request says ever becomes a file path.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import math
import socket
import sys
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match

from localllm import server_anthropic, server_ollama, server_openai
from localllm.batching import STEP_TOKENS
from localllm.errors import LocalLLMError
from localllm.models import DEFAULT_CTX, Model, load_model
from localllm.server_cors import CORSPolicy, cors_warning
from localllm.server_engine import Engine, EngineBusy
from localllm.server_jobs import State, internal_error
from localllm.server_schema import (
    APIError,
    bad_request,
)

# Not the default of Ollama (11434), llama.cpp (8080), LM Studio (1234), vLLM (8000), nor of
# the usual web tools (3000, 5000, 7860, 8000, 8080, 8888), nor in /etc/services.
DEFAULT_PORT = 8357
DEFAULT_PARALLEL = 4  # sequences decoded in turn; each holds a KV cache
DEFAULT_MAX_QUEUE = 32  # requests waiting beyond those (no cache yet); past it, 503
DEFAULT_KEEP_ALIVE = 300.0  # seconds an idle model stays loaded: Ollama's 5 minutes
SWEEP_SECONDS = 1.0  # how often idle models are checked against their keep-alive
MAX_BODY_BYTES = 4 * 1024 * 1024
REPEAT_LAST_N = 64  # penalty window, llama.cpp's default (the one `localllm run` uses)
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})

log = logging.getLogger("localllm.server")


# -- models ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServedModel:
    """A model the server answers for: its id in the API and its GGUF file."""

    id: str
    path: Path


@dataclass(frozen=True)
class LoadedModel:
    """A model in memory, as GET /api/ps reports it (taken when it is loaded)."""

    id: str
    path: Path
    architecture: str
    n_params: int
    quant: str | None
    n_ctx: int
    nbytes: int  # the file plus the KV cache of one full context
    device: str  # the backend's name: "cpu" or "cuda"
    stopping_since: datetime | None = None  # set while an unload waits for running requests
    expires: float = math.inf  # when it unloads if idle (time.time()); inf: kept loaded

    @classmethod
    def of(cls, model_id: str, model: Model) -> LoadedModel:
        from localllm.store import detect_quant

        transformer = model.transformer
        return cls(
            id=model_id,
            path=model.path,
            architecture=str(model.metadata.get("general.architecture", "")),
            n_params=sum(math.prod(t.shape) for t in model.gguf.tensors.values()),
            quant=detect_quant(model.path),
            n_ctx=model.n_ctx,
            nbytes=model.gguf.file_size + transformer.kv_nbytes,
            device=getattr(transformer.backend, "name", "cpu"),
        )


class ModelPool:
    """The served models, loaded on first use (on the engine thread) and unloaded once idle
    for their keep-alive: the server's (`serve --keep-alive`, Ollama's 5 minutes by default),
    or what the last request on the model asked for (Ollama's `keep_alive`: 0 unloads when it
    ends, a negative one never).

    With `specs` (names of installed models, or .gguf paths given by the operator) only those
    are served; without, every model installed in the store is. A request's model name is only
    ever looked up, never opened as a path, and nothing is pulled.
    """

    def __init__(
        self,
        specs: list[str],
        engine: Engine,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        device: str = "auto",
        keep_alive: float = DEFAULT_KEEP_ALIVE,
        kv_size: int | None = None,
    ) -> None:
        self._engine = engine
        self._load_args = (n_ctx, n_threads, device)
        self.kv_size = kv_size  # positions in a model's KV pool (None: parallel x its context)
        self.keep_alive = keep_alive  # seconds; math.inf: never unloaded for idleness
        self._loaded: dict[str, Model] = {}
        self._ctx_lengths: dict[str, int] = {}
        self._fixed: dict[str, ServedModel] | None = None
        # What /api/ps reports and unloading needs (see the methods after context_length).
        self._lock = threading.Lock()  # guards _info, _stopping and _digests
        self._info: dict[str, LoadedModel] = {}  # id -> the loaded model, as /api/ps says
        self._stopping: dict[str, datetime] = {}  # id -> when its unload was asked for
        self._running: dict[str, int] = {}  # id -> sequences using it (engine thread only)
        self._expires: dict[str, float] = {}  # id -> when it unloads, idle (time.time())
        self._digests: dict[Path, str] = {}
        if specs:
            self._fixed = {}
            from localllm.store import find_model

            for spec in specs:
                found = find_model(spec)  # never pulls
                # A file given by path is served under its name without .gguf.
                served_id = found.name if found.installed else found.path.name.removesuffix(".gguf")
                served = ServedModel(served_id, found.path)
                self._fixed.setdefault(served.id, served)
                self._fixed.setdefault(spec, served)  # the name as given is accepted too

    def find(self, name: str) -> ServedModel | None:
        """The model a request names, or None (-> 404)."""
        if self._fixed is not None:
            return self._fixed.get(name)
        from localllm.store import Store, is_path

        if not isinstance(name, str) or is_path(name):
            return None
        try:
            installed = Store().resolve(name)
        except LocalLLMError:  # not a valid model name
            return None
        return None if installed is None else ServedModel(installed.name, installed.path)

    def list(self) -> list[ServedModel]:
        """Every model this server answers for, once each."""
        if self._fixed is not None:
            return list({m.id: m for m in self._fixed.values()}.values())
        from localllm.store import Store

        return [ServedModel(m.name, m.path) for m in Store().list() if m.path.is_file()]

    async def load(self, served: ServedModel) -> Model:
        """The loaded model (loading it on the engine thread the first time)."""
        model = self._loaded.get(served.id)
        if model is None:
            future = self._engine.call(partial(self._load_on_engine, served))
            model = await asyncio.wrap_future(future)
        return model

    def _load_on_engine(self, served: ServedModel) -> Model:
        # Loads run one at a time on the engine thread, so a model is never loaded twice;
        # the backend's thread count is also per thread in Numba, and this is the thread
        # that runs the model.
        model = self._loaded.get(served.id)
        if model is None:
            n_ctx, n_threads, device = self._load_args
            model = load_model(served.path, n_ctx=n_ctx, n_threads=n_threads, device=device)
            if model.config.causal:
                # one pool for every sequence; each running one never needs more than a context
                kv_size = self.kv_size or self._engine.parallel * model.n_ctx
                model.transformer.size_pool(kv_size, hard=True)
            self._loaded[served.id] = model
            with self._lock:
                self._info[served.id] = LoadedModel.of(served.id, model)
            self._keep(served.id, None)
            log.info("loaded %s (context %d) in %.1f s", served.id, model.n_ctx, model.load_seconds)
        return model

    def context_length(self, served: ServedModel) -> int:
        """The context size the model has or will have once loaded (reads the GGUF header)."""
        if served.id in self._loaded:
            return self._loaded[served.id].n_ctx
        n_ctx = self._load_args[0]
        if n_ctx is not None:
            return n_ctx
        if served.id not in self._ctx_lengths:
            from localllm.gguf import read_gguf

            gguf = read_gguf(served.path)
            try:
                arch = gguf.metadata.get("general.architecture")
                # load_model's default: min(training context, DEFAULT_CTX).
                n_train = int(gguf.metadata.get(f"{arch}.context_length", 2048))
            finally:
                gguf.close()
            self._ctx_lengths[served.id] = min(n_train, DEFAULT_CTX)
        return self._ctx_lengths[served.id]

    # Unloading. A model is only closed on the engine thread, between two steps, and only when
    # no sequence is using it: asked while requests run on it, the unload waits for the last of
    # them to end (new ones may still join; /api/ps shows it as stopping meanwhile). A sequence
    # takes the model from the pool when it starts, so one that was queued behind an unload
    # loads the model again instead of running on a closed one.

    def checkout(self, served: ServedModel, keep_alive: float | None = None) -> Model:
        """The loaded model for a sequence starting now (engine thread; loads it if needed).
        `keep_alive`: how long the model stays loaded once idle (None: the server's)."""
        model = self._load_on_engine(served)
        self._running[served.id] = self._running.get(served.id, 0) + 1
        self._keep(served.id, keep_alive)
        return model

    def checkin(self, served: ServedModel, keep_alive: float | None = None) -> None:
        """A sequence is done with its model (engine thread); a pending unload happens now,
        and the keep-alive counts from now."""
        self._running[served.id] -= 1
        if self._running[served.id]:
            return
        if served.id in self._stopping or keep_alive == 0:
            self._unload_now(served.id)
        else:
            self._keep(served.id, keep_alive)

    async def keep(self, served: ServedModel, keep_alive: float | None) -> None:
        """Keep a loaded model for `keep_alive` seconds from now (Ollama's load request)."""
        await asyncio.wrap_future(self._engine.call(partial(self._keep, served.id, keep_alive)))

    def _keep(self, model_id: str, keep_alive: float | None) -> None:
        if model_id not in self._loaded:
            return
        seconds = self.keep_alive if keep_alive is None else keep_alive
        with self._lock:
            self._expires[model_id] = time.time() + seconds if seconds >= 0 else math.inf
        if seconds == 0 and not self._running.get(model_id):
            self._unload_now(model_id)

    def expires(self, model_id: str) -> float:
        """When a loaded model unloads if it stays idle (time.time(); math.inf: never)."""
        with self._lock:
            return self._expires.get(model_id, math.inf)

    def unload_expired(self) -> None:
        """Unload the idle models whose keep-alive has run out (run now and then)."""
        now = time.time()
        with self._lock:
            due = [m for m, when in self._expires.items() if when <= now]
        if due:
            self._engine.call(partial(self._unload_if_idle, due, now))

    def _unload_if_idle(self, model_ids: list[str], now: float) -> None:
        for model_id in model_ids:
            idle = model_id in self._loaded and not self._running.get(model_id)
            if idle and self.expires(model_id) <= now:
                log.info("%s has been idle for its keep-alive", model_id)
                self._unload_now(model_id)

    async def unload(self, served: ServedModel) -> None:
        """Unload a model now, or once the requests running on it end (a no-op if not loaded)."""
        future = self._engine.call(partial(self._unload_on_engine, served.id))
        await asyncio.wrap_future(future)

    def _unload_on_engine(self, model_id: str) -> None:
        if model_id not in self._loaded:
            return
        if self._running.get(model_id, 0):
            with self._lock:
                self._stopping.setdefault(model_id, datetime.now(timezone.utc))
            log.info("%s will be unloaded when its running requests end", model_id)
        else:
            self._unload_now(model_id)

    def _unload_now(self, model_id: str) -> None:
        with self._lock:
            self._info.pop(model_id, None)
            self._stopping.pop(model_id, None)
            self._expires.pop(model_id, None)
        self._running.pop(model_id, None)
        model = self._loaded.pop(model_id)
        # The map goes once the last reference does; requests still holding the model object
        # (built but not started) drop it when they start (see checkout).
        model.close()
        log.info("unloaded %s", model_id)

    def loaded(self) -> list[LoadedModel]:
        """The models loaded now, in load order, with when each unloads if idle, and
        `stopping_since` set for those whose unload waits for running requests."""
        with self._lock:
            return [
                replace(
                    info,
                    stopping_since=self._stopping.get(model_id),
                    expires=self._expires.get(model_id, math.inf),
                )
                for model_id, info in self._info.items()
            ]

    def digest(self, path: Path) -> str:
        """The file's sha256: the store's record when it knows the file, else hashed once
        (a .gguf path given to --model). Blocking: call it off the event loop."""
        with self._lock:
            digest = self._digests.get(path)
        if digest is not None:
            return digest
        from localllm.store import Store, sha256_file

        try:
            records = (m.sha256 for m in Store().list() if m.path.resolve() == path.resolve())
            digest = next(records, None)
        except LocalLLMError:  # a damaged manifest: hashing still works
            digest = None
        digest = digest or sha256_file(path)
        with self._lock:
            self._digests[path] = digest
        return digest

    def close(self) -> None:
        """Unmap every loaded model (after the engine has stopped)."""
        for model in self._loaded.values():
            model.close()
        self._loaded.clear()
        with self._lock:
            self._info.clear()
            self._stopping.clear()
            self._expires.clear()


async def health(request: Request) -> JSONResponse:
    """GET /health: up, and how many requests are running and waiting."""
    state: State = request.app.state.localllm
    return JSONResponse({"status": "ok", **state.engine.stats()})


# -- the guard: host, origin, key, body size ------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_header_ok(value: str) -> bool:
    # "localhost:8357" / "127.0.0.1" / "[::1]:80": the name without the port must be loopback.
    value = value.strip().lower()
    name = value[: value.find("]") + 1] if value.startswith("[") else value.rsplit(":", 1)[0]
    return name in LOOPBACK_HOSTS


def _origin_ok(origin: str) -> bool:
    try:
        host = urlsplit(origin).hostname or ""
    except ValueError:
        return False
    return host in ("localhost", "127.0.0.1", "::1")


class _Guard:
    """ASGI middleware run before routing: DNS-rebinding and browser cross-origin checks on a
    loopback bind, CORS for the origins listed with --cors-origin (OPTIONS is answered here),
    the API key, and the request body cap (413)."""

    def __init__(
        self, app, *, loopback: bool, api_key: str | None, max_body: int, cors: CORSPolicy
    ) -> None:
        self.app = app
        self.loopback = loopback
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_body
        self.cors = cors

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        listed = self.cors.allows(origin)
        if listed:  # every response to it, errors and streams included, says so
            send = _adding_headers(send, self.cors.response_headers(origin))
        error = self._check(scope, headers, listed)
        if error is not None:
            await _error_response(error)(scope, receive, send)
            return
        if scope["method"] == "OPTIONS":
            await self._options(scope, headers, listed)(scope, receive, send)
            return
        received = 0
        max_body = self.max_body

        async def limited_receive():
            # Bodies without a Content-Length (chunked) are counted as they arrive. FastAPI
            # re-raises an HTTPException from reading the body, so this becomes the 413.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_body:
                    raise HTTPException(413, _too_large(max_body))
            return message

        await self.app(scope, limited_receive, send)

    def _check(self, scope, headers: Headers, listed: bool) -> APIError | None:
        if self.loopback and not _host_header_ok(headers.get("host", "")):
            return APIError(
                403,
                "this server only answers requests addressed to localhost, 127.0.0.1 or [::1]",
                code="invalid_host",
            )
        origin = headers.get("origin")
        if self.loopback and origin is not None and not listed and not _origin_ok(origin):
            return _origin_refused(origin)
        if scope["method"] == "OPTIONS":
            return None  # browsers send preflights without the key; OPTIONS reveals nothing
        if self.api_key is not None and scope["path"] != "/health":
            auth = headers.get("authorization", "")
            scheme, _, key = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                key.strip().encode(), self.api_key
            ):
                return APIError(
                    401,
                    "Incorrect API key provided."
                    if auth
                    else "Missing API key: send "
                    "'Authorization: Bearer KEY' (the key given to --api-key).",
                    code="invalid_api_key",
                )
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return APIError(400, "invalid Content-Length header")
            if int(length) > self.max_body:
                return APIError(413, _too_large(self.max_body), code="request_too_large")
        return None

    def _options(self, scope, headers: Headers, listed: bool) -> Response:
        """A CORS preflight (204 for a listed origin, else 403), or a plain OPTIONS (204 with
        the path's methods in Allow)."""
        origin = headers.get("origin")
        if origin is not None and "access-control-request-method" in headers:
            if not listed:
                return _error_response(_origin_refused(origin))
            return Response(status_code=204, headers=self.cors.preflight_headers(headers))
        methods = set()
        for route in getattr(scope.get("app"), "routes", []):
            if isinstance(route, BaseRoute) and route.matches(scope)[0] != Match.NONE:
                methods |= getattr(route, "methods", None) or set()
        if not methods:
            return _error_response(APIError(404, f"no such endpoint: OPTIONS {scope['path']}"))
        return Response(
            status_code=204, headers={"Allow": ", ".join(sorted(methods | {"OPTIONS"}))}
        )


def _origin_refused(origin: str) -> APIError:
    return APIError(
        403,
        f"cross-origin requests from {origin} are refused; to let a web page at that origin use "
        f"this server, start it with --cors-origin {origin}",
        code="invalid_origin",
    )


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), error.status, headers=error.headers)


def _adding_headers(send, extra: list[tuple[bytes, bytes]]):
    """`send`, with `extra` headers added to the start of the response."""

    async def send_with_headers(message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return send_with_headers


def _too_large(max_body: int) -> str:
    return f"the request body is larger than the limit of {max_body} bytes"


# -- errors ---------------------------------------------------------------------------------


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 becomes OpenAI's 400, naming the first offending field."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        error = bad_request(f"the request body is not valid JSON: {detail}".rstrip(": "))
    elif not loc:
        error = bad_request(f"the request body must be a JSON object ({first['msg']})")
    else:
        param = ""
        for p in loc:
            param += f"[{p}]" if isinstance(p, int) else (f".{p}" if param else str(p))
        error = bad_request(f"{param}: {first['msg']}", param=param)
    return JSONResponse(error.body(), 400)


def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), exc.status, headers=exc.headers)


def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    code = "request_too_large" if exc.status_code == 413 else None
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404:
        message = f"no such endpoint: {request.method} {request.url.path}"
    error = APIError(exc.status_code, message, code=code)
    return JSONResponse(error.body(), exc.status_code, headers=getattr(exc, "headers", None))


def _busy(request: Request, exc: EngineBusy) -> JSONResponse:
    error = APIError(503, str(exc), type="server_error", code="server_busy")
    return JSONResponse(error.body(), 503, headers={"Retry-After": "1"})


def _server_error(request: Request, exc: Exception) -> JSONResponse:
    error = internal_error(exc)
    response = JSONResponse(error.body(), error.status)
    # Starlette sends this from outside every middleware, so the guard cannot add CORS to it.
    cors: CORSPolicy = request.app.state.cors
    origin = request.headers.get("origin")
    if cors.allows(origin):
        response.raw_headers.extend(cors.response_headers(origin))
    return response


# -- the app and the command ----------------------------------------------------------------


def create_app(
    models: list[str] | None = None,
    host: str = "127.0.0.1",
    api_key: str | None = None,
    n_ctx: int | None = None,
    n_threads: int | None = None,
    device: str = "auto",
    parallel: int = DEFAULT_PARALLEL,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_body: int = MAX_BODY_BYTES,
    cors_origins: list[str] | None = None,
    keep_alive: float = DEFAULT_KEEP_ALIVE,
    batch_size: int = STEP_TOKENS,
    kv_size: int | None = None,
) -> FastAPI:
    """The ASGI app. `models`: installed model names or .gguf paths (none: every installed
    model); `host`: the address it will be bound to (a loopback one turns on the Host and
    Origin checks); `cors_origins`: browser origins allowed to read responses (none: CORS off).
    Raises LocalLLMError for a model that is not there or an origin that is not one."""
    cors = CORSPolicy(cors_origins or [])
    engine = Engine(parallel=parallel, max_queue=max_queue, step_tokens=batch_size)
    pool = ModelPool(list(models or []), engine, n_ctx, n_threads, device, keep_alive, kv_size)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async def sweep() -> None:
            while True:
                await asyncio.sleep(SWEEP_SECONDS)
                pool.unload_expired()

        sweeper = asyncio.ensure_future(sweep())
        yield
        sweeper.cancel()
        # Unmapping the weights under a step still running would crash: only once it is done.
        if engine.stop():
            pool.close()

    app = FastAPI(
        title="localllm",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
    )
    app.state.localllm = State(engine, pool)
    app.state.cors = cors
    app.add_api_route("/v1/chat/completions", server_openai.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", server_openai.completions, methods=["POST"])
    app.add_api_route("/v1/models", server_openai.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", server_openai.get_model, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/api/ps", server_ollama.ps, methods=["GET"])
    app.add_api_route("/api/generate", server_ollama.generate, methods=["POST"])
    app.add_api_route("/api/chat", server_ollama.chat, methods=["POST"])
    app.add_api_route("/api/tags", server_ollama.tags, methods=["GET"])
    app.add_api_route("/api/show", server_ollama.show, methods=["POST"])
    app.add_api_route("/api/version", server_ollama.version, methods=["GET"])
    app.add_api_route("/api/embed", server_ollama.embed, methods=["POST"])
    app.add_api_route("/api/pull", server_ollama.pull, methods=["POST"])
    app.add_api_route("/api/delete", server_ollama.delete, methods=["DELETE"])
    app.add_api_route("/api/embeddings", server_ollama.embeddings_legacy, methods=["POST"])
    app.add_api_route("/v1/embeddings", server_openai.embeddings, methods=["POST"])
    app.add_api_route("/v1/messages", server_anthropic.messages, methods=["POST"])
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(EngineBusy, _busy)
    app.add_exception_handler(Exception, _server_error)
    app.add_middleware(
        _Guard, loopback=is_loopback(host), api_key=api_key or None, max_body=max_body, cors=cors
    )
    return app


def serve(
    models: list[str] | None = None,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    n_ctx: int | None = None,
    n_threads: int | None = None,
    device: str = "auto",
    parallel: int = DEFAULT_PARALLEL,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_body: int = MAX_BODY_BYTES,
    log_level: str = "info",
    cors_origins: list[str] | None = None,
    keep_alive: float = DEFAULT_KEEP_ALIVE,
    batch_size: int = STEP_TOKENS,
    kv_size: int | None = None,
) -> None:
    """Serve the API until interrupted (blocking). Startup messages go to stderr."""
    import uvicorn

    app = create_app(
        models,
        host,
        api_key,
        n_ctx,
        n_threads,
        device,
        parallel,
        max_queue,
        max_body,
        cors_origins,
        keep_alive,
        batch_size,
        kv_size,
    )
    sock = _listen(host, port)
    for warning in (exposure_warning(host, port, api_key), cors_warning(app.state.cors.origins)):
        if warning:
            print(warning, file=sys.stderr)
    # One line per request with its speed, in the same style as uvicorn's own log lines.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    log.addHandler(handler)
    log.setLevel(log_level.upper())
    pool: ModelPool = app.state.localllm.pool
    names = ", ".join(m.id for m in pool.list()) or "(none installed yet)"
    shown = f"[{host}]" if ":" in host else host
    print(f"localllm: serving {names} at http://{shown}:{port}/v1", file=sys.stderr)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])


def exposure_warning(host: str, port: int, api_key: str | None) -> str | None:
    """The loud warning for a server others can reach without a key, or None."""
    if is_loopback(host) or api_key:
        return None
    return (
        "\n"
        + "!" * 78
        + "\nWARNING: localllm is listening on a non-loopback address without --api-key."
        f"\nWARNING: anyone who can reach {host}:{port} can use your models and your CPU."
        "\nWARNING: pass --api-key KEY (clients send it as their OpenAI API key),"
        " or bind 127.0.0.1.\n" + "!" * 78 + "\n"
    )


def _listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket, so that a busy port is one clear error, not a traceback."""
    try:
        family, _, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        raise LocalLLMError(
            f"cannot listen on {host}:{port}: {e.strerror or e}; is another server using "
            "the port? pick another with --port"
        ) from None
    sock.set_inheritable(True)
    return sock
