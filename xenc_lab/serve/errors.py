"""Errors as vLLM's JSON body (``{"error": {"message", "type", "param", "code"}}``) and validation errors read as what
was expected."""
from __future__ import annotations

import json
from http import HTTPStatus

from .schemas import ErrorInfo, ErrorResponse


class ApiError(Exception):
    """A refusal with its HTTP status, message and headers (503's Retry-After)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


async def send_error(send, status: int, message: str, headers: dict[str, str] | None = None,
                     close: bool = False) -> None:
    """An error answered from ASGI middleware (before the app): the JSON body, and ``close`` ends the connection."""
    body = json.dumps(error_body(status, message)).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra,
        *([(b"connection", b"close")] if close else [])]})
    await send({"type": "http.response.body", "body": body})


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


def describe(errors: list[dict], most: int = 8) -> str:
    """One clause per place in the body: where, and what was expected there; the first ``most`` places, then how many
    more. Linear in the number of errors (a 4 MiB body can hold a million bad items)."""
    if bad_json := next((e for e in errors if e.get("type") == "json_invalid"), None):
        where = bad_json["loc"][-1] if isinstance(bad_json["loc"][-1], int) else "?"
        return f"the body is not valid JSON ({(bad_json.get('ctx') or {}).get('error', 'decode error')} at character {where})"
    # where a union member's own check failed (a lone surrogate), the other members' type errors say nothing
    # and where a list member failed (text_1[1]), so does the list's "or a string" error (text_1)
    found = [(_field(tuple(e.get("loc", ()))), e) for e in errors]
    checked = {where for where, e in found if e.get("type") == "value_error"}
    parents = {where[:i] for where, _ in found for i, c in enumerate(where) if c == "["}
    lines: dict[str, list[str]] = {}
    for where, e in found:
        if (where in checked and e.get("type") != "value_error") or (where and where in parents):
            continue
        message = str(e.get("msg", "invalid")).removeprefix("Value error, ").replace("Input should be ", "expected ")
        if not where and e.get("type") in ("model_attributes_type", "missing", "model_type"):
            message = "expected a JSON object (Content-Type: application/json)"
        kept = lines.setdefault(where or "body", [])
        if message not in kept:
            kept.append(message if not kept else message.removeprefix("expected "))
    clauses = [f"{where}: {' or '.join(m)}" for where, m in lines.items()]
    more = f"; and {len(clauses) - most} more places" if len(clauses) > most else ""
    return "; ".join(clauses[:most]) + more
