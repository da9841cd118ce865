"""Running the app on uvicorn: ``Server`` drains the queue on shutdown (SIGTERM, SIGINT): the engine call in progress
finishes and answers, queued requests get 503 at once, new ones 503 until the listener closes, and uvicorn waits for the
answers in flight before it exits. ``ServerThread`` runs it in a background thread on a free loopback port (the tests
and the serving benchmark); ``xenc-lab serve`` runs it in the foreground."""
from __future__ import annotations

import threading
import time

import uvicorn


def config_for(app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", timeout_keep_alive: float = 5,
               ssl_keyfile: str | None = None, ssl_certfile: str | None = None, **kwargs) -> uvicorn.Config:
    """uvicorn's Config for an app of ``create_app``: its own h11 protocol (timeouts), no uvicorn access log (the app
    logs one line per request), TLS where a key and certificate are given."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", access_log=False,
                          http=app.state.http_protocol, timeout_keep_alive=timeout_keep_alive,
                          ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile, **kwargs)


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app):
        super().__init__(config)
        self.app = app

    async def shutdown(self, sockets=None) -> None:
        batcher = getattr(self.app.state, "batcher", None)
        if batcher is not None:
            batcher.close(timeout=0)  # queued requests hear 503 now; the call in progress goes on
        await super().shutdown(sockets=sockets)


class ServerThread:
    """``with ServerThread(app) as server: httpx.get(server.url + "/health")``; the app's lifespan (the batcher's
    worker) starts and stops with the server."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", **kwargs):
        self.server = Server(config_for(app, host, port, log_level, **kwargs), app)
        self._thread = threading.Thread(target=self.server.run, name="xenc-uvicorn", daemon=True)
        self.url = ""

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see its log)")
            time.sleep(0.01)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"{'https' if self.server.config.is_ssl else 'http'}://{host}:{port}"
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
