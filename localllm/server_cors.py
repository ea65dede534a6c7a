"""CORS for `localllm serve --cors-origin ORIGIN` (or $LOCALLLM_ORIGINS): off unless origins are
listed, as in llama-server and Ollama (OLLAMA_ORIGINS), so that no web page can read the API by
default.

The guard in `server.py` applies the policy: it answers every OPTIONS request itself, before the
API key is checked (browsers send preflights without it), and adds Access-Control-Allow-Origin
to every response for a listed origin, errors and streams included. Starlette's CORSMiddleware
is not used: it answers preflights 200 and refusals 400 in plain text, and, placed outside the
guard (it has to be, or the key check refuses every preflight), it could not make the guard's
loopback Origin check let listed origins through.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from starlette.datastructures import Headers

from localllm.errors import LocalLLMError

ALLOW_METHODS = "GET, POST, OPTIONS"
# Always allowed; more are allowed as a preflight asks for them (see preflight_headers).
BASE_HEADERS = ("Authorization", "Content-Type")
MAX_AGE_S = 600  # how long a browser may cache a preflight (Chrome caps it at 7200)

_ORIGIN_RE = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+")
_TOKEN_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP header name


def parse_origins(values: Iterable[str]) -> list[str]:
    """The origins of --cors-origin/$LOCALLLM_ORIGINS, checked and normalized (lower case, no
    trailing slash). `*` alone allows any origin; inside an origin it matches any characters
    (http://localhost:*, as OLLAMA_ORIGINS takes)."""
    origins = []
    for value in values:
        origin = value.strip().lower().removesuffix("/")
        if not origin:
            continue
        if origin != "*" and not _ORIGIN_RE.fullmatch(origin):
            raise LocalLLMError(
                f"--cors-origin {value!r} is not an origin: write scheme://host[:port] without "
                "a path, e.g. http://localhost:3000 (or * for any origin)"
            )
        origins.append(origin)
    return origins


def cors_warning(origins: Iterable[str]) -> str | None:
    """The warning for `--cors-origin *`, or None."""
    if "*" not in origins:
        return None
    return (
        "Warning: --cors-origin '*': any web page open in a browser on a machine that can reach "
        "this server may use its API; list the origins of your apps instead"
    )


class CORSPolicy:
    """Which browser origins may read the API's responses."""

    def __init__(self, origins: Iterable[str] = ()) -> None:
        self.origins = parse_origins(origins)
        self._patterns = [
            re.compile(".*".join(re.escape(part) for part in origin.split("*")))
            for origin in self.origins
        ]

    def allows(self, origin: str | None) -> bool:
        """Whether responses to `origin` (a request's Origin header) carry CORS headers."""
        if not origin:
            return False
        origin = origin.strip().lower()
        return any(pattern.fullmatch(origin) for pattern in self._patterns)

    @staticmethod
    def response_headers(origin: str) -> list[tuple[bytes, bytes]]:
        """The headers every response to an allowed origin gets (raw, for ASGI)."""
        # The origin is echoed (never `*`), so caches must keep answers apart per Origin.
        return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]

    @staticmethod
    def preflight_headers(request_headers: Headers) -> dict[str, str]:
        """What a preflight from an allowed origin is answered with, besides response_headers.

        The headers it asks for are allowed: the origin is trusted, and a header grants nothing
        (the key is still checked); a fixed list would go stale as the OpenAI JS client adds
        its own (x-stainless-*)."""
        asked = request_headers.get("access-control-request-headers", "")
        names = {name.lower(): name for name in BASE_HEADERS}
        for name in asked.split(","):
            name = name.strip()
            if _TOKEN_RE.fullmatch(name):
                names.setdefault(name.lower(), name)
        headers = {
            "Access-Control-Allow-Methods": ALLOW_METHODS,
            "Access-Control-Allow-Headers": ", ".join(names.values()),
            "Access-Control-Max-Age": str(MAX_AGE_S),
            "Vary": "Access-Control-Request-Headers",
        }
        # Chrome's Private Network Access: a public page calling a server on this machine.
        if request_headers.get("access-control-request-private-network") == "true":
            headers["Access-Control-Allow-Private-Network"] = "true"
        return headers
