"""Errors as vLLM's JSON body (``{"error": {"message", "type", "param", "code"}}``), validation errors read as what was
expected, and the request-size limit, checked before a body is parsed."""
from __future__ import annotations

import json
from http import HTTPStatus

from .schemas import ErrorInfo, ErrorResponse


class ApiError(Exception):
    """A refusal with its HTTP status, message and headers (503's Retry-After)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


def error_body(status: int, message: str) -> dict:
    kind = HTTPStatus(status).phrase.title().replace(" ", "").replace("-", "")  # "Not Found" -> NotFoundError
    kind = kind if kind.endswith("Error") else kind + "Error"
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, code=status)).model_dump()


def _field(loc: tuple) -> str:
    # ("body", "text_1", "list[str]", 3) -> "text_1[3]": the body's place, without pydantic's union member tags
    name = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part.isidentifier() and part != "str":
            name += f".{part}" if name else part
    return name


def describe(errors: list[dict]) -> str:
    """One clause per place in the body: where, and what was expected there."""
    if bad_json := next((e for e in errors if e.get("type") == "json_invalid"), None):
        where = bad_json["loc"][-1] if isinstance(bad_json["loc"][-1], int) else "?"
        return f"the body is not valid JSON ({(bad_json.get('ctx') or {}).get('error', 'decode error')} at character {where})"
    # where a union member's own check failed (a lone surrogate), the other members' type errors say nothing
    # and where a list member failed (text_1[1]), so does the list's "or a string" error (text_1)
    places = {_field(tuple(e.get("loc", ()))) for e in errors}
    checked = {_field(tuple(e.get("loc", ()))) for e in errors if e.get("type") == "value_error"}
    lines: dict[str, list[str]] = {}
    for e in errors:
        where = _field(tuple(e.get("loc", ())))
        if (where in checked and e.get("type") != "value_error") or (where and any(
                p.startswith(where + "[") for p in places)):
            continue
        message = str(e.get("msg", "invalid")).removeprefix("Value error, ").replace("Input should be ", "expected ")
        if not where and e.get("type") in ("model_attributes_type", "missing"):
            message = "expected a JSON object (Content-Type: application/json)"
        kept = lines.setdefault(where or "body", [])
        if message not in kept:
            kept.append(message if not kept else message.removeprefix("expected "))
    return "; ".join(f"{where}: {' or '.join(m)}" for where, m in lines.items())


class BodyLimit:
    """ASGI middleware: a body over ``max_bytes`` gets 413 before it is read whole or parsed (a declared length over the
    limit at once; an undeclared one, chunk by chunk)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def _refuse(self, send, message: str) -> None:
        body = json.dumps(error_body(413, message)).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = f"at most {self.max_bytes} bytes per request body (--max-request-bytes)"
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._refuse(send, f"{limit}; this one declares {declared.decode(errors='replace')}")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send, f"{limit}; this one sent more")
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
