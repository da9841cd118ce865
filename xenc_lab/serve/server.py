"""A uvicorn server in a background thread, on a free loopback port by default: what the tests and the serving
benchmark run the app in (``xenc-lab serve`` runs uvicorn in the foreground instead)."""
from __future__ import annotations

import threading
import time


class ServerThread:
    """``with ServerThread(app) as server: httpx.get(server.url + "/health")``; the app's lifespan (the batcher's
    worker) starts and stops with the server."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on"))
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
        self.url = f"http://{host}:{port}"
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
