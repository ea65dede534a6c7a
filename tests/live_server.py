"""A real `localllm serve` app on a free loopback port, for the server tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from real_models import model_path

from localllm.server import create_app

N_CTX = 512


@contextmanager
def running_server(**kwargs) -> Iterator[tuple[str, object]]:
    """(base URL, app) of a server on a free loopback port, shut down afterwards."""
    kwargs.setdefault("models", [str(model_path("smollm2-135m"))])
    kwargs.setdefault("n_ctx", N_CTX)
    app = create_app(device="cpu", **kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60  # only against a hang
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
