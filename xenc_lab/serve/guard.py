"""ASGI middleware between the access log and the app: the API key (as vLLM's ``--api-key``: every route but
``/health`` needs ``Authorization: Bearer KEY``, compared in constant time) and the per-request deadline
(``--request-timeout``: a request not answered that many seconds after its body arrived gets 504, and its queued work is
given up)."""
from __future__ import annotations

import asyncio
import hmac

from .errors import send_error

OPEN_PATHS = {"/health"}


class ApiKey:
    def __init__(self, app, key: str):
        self.app, self._expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = b"".join(v for k, v in scope.get("headers") or [] if k == b"authorization")
        if not hmac.compare_digest(given, self._expected):
            return await send_error(send, 401, "Unauthorized: this server needs the header Authorization: Bearer "
                                               "<its API key>", {"WWW-Authenticate": "Bearer"})
        return await self.app(scope, receive, send)


class Deadline:
    def __init__(self, app, seconds: float, on_timeout=lambda: None):
        self.app, self.seconds, self.on_timeout = app, seconds, on_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def sending(message):
            nonlocal started
            started = True
            await send(message)

        try:
            return await asyncio.wait_for(self.app(scope, receive, sending), self.seconds)
        except asyncio.TimeoutError:
            self.on_timeout()
            if started:  # cut mid-answer: the connection is dropped rather than finished wrong
                raise
            return await send_error(send, 504, f"the request was not answered within {self.seconds:g} s "
                                               "(--request-timeout)", {"Retry-After": "1"})
