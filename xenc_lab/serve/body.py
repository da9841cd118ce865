"""ASGI middleware that reads a request's body whole before the app sees it, within a size limit (413) and a time limit
(408): a body over ``max_bytes`` is refused from its declared length before it is read, or as soon as the bytes received
pass the limit; a body that has not arrived ``timeout`` seconds after the request's head (a stalled or trickling client,
"slowloris") is answered 408 and its connection closed. uvicorn has neither limit of its own."""
from __future__ import annotations

import asyncio

from .errors import send_error


class BodyReader:
    def __init__(self, app, max_bytes: int, timeout: float, on_timeout=lambda: None):
        self.app, self.max_bytes, self.timeout, self.on_timeout = app, max_bytes, timeout, on_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = f"at most {self.max_bytes} bytes per request body (--max-request-bytes)"
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await send_error(send, 413, f"{limit}; this one declares {declared.decode(errors='replace')[:40]}",
                                    close=True)
        chunks: list[bytes] = []

        async def read() -> str:  # "done", or why the body was not read: "gone" (the client left), "large"
            size = 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return "gone"
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > self.max_bytes:
                    return "large"
                if not message.get("more_body", False):
                    return "done"

        try:
            outcome = await asyncio.wait_for(read(), self.timeout)
        except asyncio.TimeoutError:
            self.on_timeout()
            return await send_error(send, 408, f"the request body did not arrive within {self.timeout:g} s "
                                               f"(--body-timeout); {sum(map(len, chunks))} bytes came", close=True)
        if outcome == "gone":
            return None
        if outcome == "large":
            return await send_error(send, 413, f"{limit}; this one sent more", close=True)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
