"""A small client for a running `localllm serve`, used by `localllm ps` and `localllm stop`.

It speaks the server's Ollama routes (GET /api/ps; POST /api/generate with keep_alive 0) over
the standard library's urllib: httpx is only a test dependency of localllm, and two JSON calls
need nothing more. As in Ollama's client, requests to the loopback never go through a proxy.
"""

from __future__ import annotations

import ipaddress
import json
import os
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from localllm.errors import LocalLLMError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8357  # localllm.server.DEFAULT_PORT, written out so that FastAPI is not imported
TIMEOUT_S = 60.0  # the first `ps` of a model given as a path hashes its file


class ServerError(LocalLLMError):
    """The server answered with an HTTP error."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def server_url(host: str | None = None, port: int | None = None) -> str:
    """The server's base URL: --host/--port, else $LOCALLLM_HOST (host, host:port or a URL, as
    OLLAMA_HOST takes), else http://127.0.0.1:8357."""
    value = (host or os.environ.get("LOCALLLM_HOST", "")).strip()
    scheme, sep, rest = value.partition("://")
    if not sep:
        scheme, rest, default_port = "http", value, DEFAULT_PORT
    else:
        scheme = scheme.lower()
        if scheme not in ("http", "https"):
            raise LocalLLMError(f"{value!r}: the server's address must be http:// or https://")
        default_port = 443 if scheme == "https" else 80
    try:
        parts = urlsplit(f"{scheme}://{rest}")
        name, given_port = parts.hostname or DEFAULT_HOST, parts.port
    except ValueError as e:
        raise LocalLLMError(
            f"{value!r} is not a server address ({e}); write HOST:PORT, e.g. 127.0.0.1:8357"
        ) from None
    if _is_unspecified(name):  # 0.0.0.0 is where a server listens, not where to connect
        name = "::1" if ":" in name else DEFAULT_HOST
    shown = f"[{name}]" if ":" in name else name
    port = port or given_port or default_port
    return f"{scheme}://{shown}:{port}{parts.path.rstrip('/')}"


def _is_unspecified(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_unspecified
    except ValueError:
        return False


def _is_loopback(url: str) -> bool:
    name = urlsplit(url).hostname or ""
    try:
        return name == "localhost" or ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def request_json(
    url: str, method: str, path: str, body: Any = None, api_key: str | None = None
) -> Any:
    """One JSON request to the server at `url`; its decoded answer, or LocalLLMError."""
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url + path, data=data, headers=headers, method=method)
    handlers = [urllib.request.ProxyHandler({})] if _is_loopback(url) else []
    try:
        with urllib.request.build_opener(*handlers).open(request, timeout=TIMEOUT_S) as response:
            raw = response.read()
    except urllib.error.HTTPError as e:
        raise _http_error(url, e.code, e.read(), api_key) from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, ConnectionRefusedError):
            raise LocalLLMError(
                f"no localllm server at {url}; start one with `localllm serve`"
            ) from None
        raise LocalLLMError(f"cannot reach a localllm server at {url}: {e.reason}") from None
    except TimeoutError:
        raise LocalLLMError(f"the server at {url} did not answer in {TIMEOUT_S:.0f} s") from None
    except OSError as e:  # e.g. the connection was reset
        raise LocalLLMError(f"the connection to the server at {url} failed: {e}") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise LocalLLMError(
            f"the server at {url} is not a localllm server (its answer to {path} is not JSON)"
        ) from None


def _http_error(url: str, status: int, raw: bytes, api_key: str | None) -> ServerError:
    if status == 401:
        if api_key:
            return ServerError(f"the server at {url} refused the API key", status)
        return ServerError(
            f"the server at {url} needs an API key: pass --api-key KEY or set LOCALLLM_API_KEY",
            status,
        )
    try:
        error = json.loads(raw)["error"]  # Ollama's {"error": "..."} or OpenAI's envelope
        message = error["message"] if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        message = raw.decode("utf-8", "replace").strip()[:200] or "(no message)"
    return ServerError(f"the server at {url} answered {status}: {message}", status)


def loaded_models(url: str, api_key: str | None = None) -> list[dict[str, Any]]:
    """GET /api/ps: the models loaded in the server now, in Ollama's shape."""
    answer = request_json(url, "GET", "/api/ps", api_key=api_key)
    models = answer.get("models") if isinstance(answer, dict) else None
    if not isinstance(models, list):
        raise LocalLLMError(f"the server at {url} is not a localllm server (no models in /api/ps)")
    return models


def unload(url: str, name: str, api_key: str | None = None) -> str:
    """Ask the server to unload model `name` (at once, or when its running requests end); the
    name the server knows it by."""
    body = {"model": name, "keep_alive": 0}
    try:
        answer = request_json(url, "POST", "/api/generate", body, api_key=api_key)
    except ServerError as e:
        if e.status == 404:  # "model 'NAME' not found"
            raise LocalLLMError(f"{e}; GET {url}/v1/models lists the models it serves") from None
        raise
    return answer.get("model", name) if isinstance(answer, dict) else name
