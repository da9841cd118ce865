"""ASGI middleware, outermost: one structured access-log line per request (JSON: method, route, status, pairs, tokens,
ms, client) on the ``xenc_lab.serve.access`` logger, and the request metrics (by route and status, latency). Handlers
put the pairs and tokens they answered in ``scope["xenc"]``. Headers (an API key) are never logged, nor query
strings."""
from __future__ import annotations

import json
import logging
import time

logger = logging.getLogger("xenc_lab.serve.access")


class AccessLog:
    def __init__(self, app, metrics, routes: set[str]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), None
        scope["xenc"] = info = {}

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            status = status or 500  # answered by the server's error middleware, outside this one
            raise
        finally:
            seconds = time.perf_counter() - start
            route = scope["path"] if scope["path"] in self.routes else "other"  # bounded label values
            code = str(status) if status is not None else "none"  # none: the client left before an answer
            self.metrics.requests.labels(route, code).inc()
            self.metrics.latency.labels(route).observe(seconds)
            if status == 200 and "pairs" in info:
                self.metrics.pairs.inc(info["pairs"])
                self.metrics.tokens.inc(info.get("tokens", 0))
            client = scope.get("client")
            logger.info(json.dumps({
                "method": scope["method"], "route": route if route != "other" else scope["path"][:200],
                "status": status, "pairs": info.get("pairs"), "tokens": info.get("tokens"),
                "ms": round(seconds * 1000, 2), "client": f"{client[0]}:{client[1]}" if client else None}))
