"""A fake Hugging Face Hub on 127.0.0.1 and a tiny GGUF to serve: for test_pull.py and test_cli.py.

It answers like huggingface.co's resolve endpoint (HEAD and GET, Range `a-` and `a-b`, ETag, the
redirect to a CDN with X-Linked-Size / X-Linked-Etag) and `/api/models/{repo}`; tests point
HF_ENDPOINT at it.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gguf_writer import gguf_bytes

REPO = "tester/tiny-GGUF"
FILE = "tiny-Q4_K_M.gguf"


def tiny_gguf(file_type: int = 15, size: int = 400_000) -> bytes:
    """A valid GGUF with no tensors, padded to about `size` bytes with a description string."""
    return gguf_bytes(
        {
            "general.architecture": "llama",
            "general.file_type": file_type,
            "general.description": "".join(chr(65 + i % 26) for i in range(size)),
        }
    )


DATA = tiny_gguf()
SHA = hashlib.sha256(DATA).hexdigest()


class FakeHub:
    """A tiny stand-in for the Hub: files by "user/repo/path", and knobs for misbehaving."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.drop_after: dict[str, int] = {}  # key -> close the connection after N body bytes
        self.corrupt: set[str] = set()  # keys whose body has one byte flipped
        self.redirect = False  # resolve answers 302 to /cdn/ with X-Linked-* headers
        self.delay_s = 0.0  # pause between body chunks
        # When set to an Event: each body stops after its first chunk until the event is set.
        self.hold: threading.Event | None = None
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.handle(self, head=True)

            def do_GET(self) -> None:
                hub.handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def gets(self, key: str) -> list[str | None]:
        """The Range header of every GET that served the file `key`."""
        paths = (f"/{key.rsplit('/', 1)[0]}", f"/cdn/{key}")
        return [r for m, p, r in self.requests if m == "GET" and p.startswith(paths) and
                p.endswith(key.rsplit("/", 1)[1])]  # fmt: skip

    def handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        self.requests.append((h.command, h.path, h.headers.get("Range")))
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)", h.path):
            siblings = [{"rfilename": k.split("/", 2)[2]} for k in self.files
                        if k.startswith(m[1] + "/")]  # fmt: skip
            if not siblings:
                return self.reply(h, 404, b"", {"X-Error-Code": "RepoNotFound"})
            return self.reply(h, 200, json.dumps({"id": m[1], "siblings": siblings}).encode())
        if m := re.fullmatch(r"/cdn/(.+)", h.path):
            return self.serve(h, m[1], head)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", h.path)
        if not m:
            return self.reply(h, 404, b"")
        key = f"{m[1]}/{m[3]}"
        if not any(k.startswith(m[1] + "/") for k in self.files):
            return self.reply(h, 404, b"", {"X-Error-Code": "RepoNotFound"})
        if key not in self.files:
            return self.reply(h, 404, b"", {"X-Error-Code": "EntryNotFound"})
        if self.redirect:
            data = self.files[key]
            headers = {
                "Location": f"/cdn/{key}",
                "X-Linked-Size": str(len(data)),
                "X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"',
                "X-Repo-Commit": "0" * 40,
            }
            return self.reply(h, 302, b"", headers)
        return self.serve(h, key, head)

    def serve(self, h: BaseHTTPRequestHandler, key: str, head: bool) -> None:
        data = self.files[key]
        etag = hashlib.sha256(data).hexdigest()
        if key in self.corrupt:
            middle = len(data) // 2
            data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]
        start, status = 0, 200
        headers = {"ETag": f'"{etag}"', "Accept-Ranges": "bytes", "X-Repo-Commit": "0" * 40}
        end = len(data)  # exclusive
        if (rng := h.headers.get("Range")) and not head:
            first, last = re.fullmatch(r"bytes=(\d+)-(\d*)", rng).groups()
            start, end = int(first), min(int(last) + 1, end) if last else end
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        body = data[start:end]
        drop = self.drop_after.pop(key, None) if not head else None
        h.send_response(status)
        for name, value in headers.items():
            h.send_header(name, value)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if head:
            return
        if drop is not None:
            h.wfile.write(body[:drop])
            h.wfile.flush()
            h.close_connection = True
            return
        for i in range(0, len(body), 64 * 1024):
            h.wfile.write(body[i : i + 64 * 1024])
            if self.hold is not None:
                self.hold.wait(60)  # the test sets it; 60 s only so that nothing hangs forever
            time.sleep(self.delay_s)

    def reply(self, h, status: int, body: bytes, headers: dict | None = None) -> None:
        h.send_response(status)
        for name, value in (headers or {}).items():
            h.send_header(name, value)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
