"""The part of Ollama's native API that `localllm ps` and `localllm stop` use, in Ollama's wire
format: GET /api/ps (the models loaded now) and POST /api/generate with `keep_alive: 0` and no
prompt (unload a model). Errors here come in Ollama's shape, {"error": "..."}.

The rest of Ollama's API (generating with /api/generate, /api/chat, /api/tags, ...) is a later
issue; until then every other /api/generate body is answered 501.
"""

from __future__ import annotations

import asyncio
import json
import re
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse

from localllm.server_engine import EngineBusy

if TYPE_CHECKING:
    from localllm.server import LoadedModel, ModelPool

# Models stay loaded until stopped. Ollama reports that (keep_alive -1) as an expiry far ahead,
# which its clients show as "Forever" (anything more than 20 years away).
KEPT_LOADED = timedelta(days=100 * 365)

# keep_alive is seconds as a number, or a Go duration string ("0", "0s", "0m", "0h0m0s").
_ZERO_DURATION = re.compile(r"[+-]?(0|((0+(\.0*)?|\.0+)(ns|us|µs|μs|ms|s|m|h))+)")


def timestamp(when: datetime) -> str:
    """RFC 3339 in UTC, as Ollama writes its times: 2024-06-04T14:38:31.837530Z."""
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status)


def _pool(request: Request) -> ModelPool:
    return request.app.state.localllm.pool


async def ps(request: Request) -> JSONResponse:
    """GET /api/ps: the models loaded now, as Ollama lists its running models."""
    pool = _pool(request)
    now = datetime.now(timezone.utc)
    models = []
    for info in pool.loaded():
        digest = await asyncio.to_thread(pool.digest, info.path)  # may hash the file, once
        models.append(_running_model(info, digest, now))
    return JSONResponse({"models": models})


def _running_model(info: LoadedModel, digest: str, now: datetime) -> dict[str, Any]:
    from localllm.describe import format_count

    # Stopping (waiting for its running requests): an expiry in the past, which Ollama's
    # clients show as "Stopping...".
    expires = info.stopping_since or now + KEPT_LOADED
    return {
        "name": info.id,
        "model": info.id,
        "size": info.nbytes,
        "digest": digest,
        "details": {
            "parent_model": "",
            "format": "gguf",
            "family": info.architecture,
            "families": [info.architecture],
            "parameter_size": format_count(info.n_params),
            "quantization_level": info.quant or "",
        },
        "expires_at": timestamp(expires),
        "size_vram": info.nbytes if info.device == "cuda" else 0,
        "context_length": info.n_ctx,
    }


def is_zero_keep_alive(value: Any) -> bool:
    """Whether a request's keep_alive means "unload now" (0 s as a number or a duration)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return value == 0
    return isinstance(value, str) and _ZERO_DURATION.fullmatch(value) is not None


async def generate(request: Request) -> JSONResponse:
    """POST /api/generate. Only Ollama's unload request is served so far:
    {"model": NAME, "keep_alive": 0} with no prompt."""
    try:
        body = json.loads(await request.body())
    except ValueError as e:  # also UnicodeDecodeError
        return _error(400, f"the request body is not valid JSON: {e}")
    if not isinstance(body, dict):
        return _error(400, "the request body must be a JSON object")
    name = body.get("model")
    if not isinstance(name, str) or not name:
        return _error(400, "model is required")
    pool = _pool(request)
    served = await asyncio.to_thread(pool.find, name)
    if served is None:
        return _error(404, f"model '{name}' not found")
    # The rest of Ollama's API is a later issue: generating here, and loading (no prompt and no
    # keep_alive 0), are not served yet.
    if body.get("prompt") or not is_zero_keep_alive(body.get("keep_alive")):
        return _error(
            501,
            "not implemented yet: /api/generate only unloads a model so far "
            '({"model": NAME, "keep_alive": 0}); generate with POST /v1/completions or '
            "/v1/chat/completions",
        )
    try:
        # At once when idle; else once the requests running on it end (this does not wait).
        await pool.unload(served)
    except EngineBusy as e:
        return _error(503, str(e))
    return JSONResponse(
        {
            "model": served.id,
            "created_at": timestamp(datetime.now(timezone.utc)),
            "response": "",
            "done": True,
            "done_reason": "unload",
        }
    )
