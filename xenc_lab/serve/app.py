"""The HTTP app: vLLM's scoring routes (``/score``, ``/v1/score``, ``/rerank``, ``/v1/rerank``, ``/v2/rerank``) and
``/health``, ``/v1/models``, ``/metrics``, over one Scorer whose model is fixed at start.

A request's body is read whole within the size and time limits (``body``), its key checked (``guard``), then parsed and
checked on a worker thread (``parse``), queued on the batcher (which shares ``predict`` calls between clients) and
counted on the token counter's thread meanwhile: nothing of a request's size runs on the event loop. Client input never
gets a 5xx: bad input is 400 (404 for another model's name, 413 for a body over the limit, 408 for one that does not
arrive), a full queue or a shutdown 503 with Retry-After, a request past its deadline 504.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from .access import AccessLog
from .batcher import Batcher, QueueFull, Unavailable
from .body import BodyReader
from .errors import ApiError, describe, error_body
from .guard import ApiKey, Deadline
from .metrics import Metrics
from .parse import Parsed, parse
from .protocol import timed_protocol
from .schemas import (ErrorResponse, ModelCard, ModelList, Options, RerankDocument, RerankRequest, RerankResponse,
                      RerankResult, RerankUsage, ScoreData, ScoreRequest, ScoreResponse, Usage, new_id)
from .usage import TokenCounter

ERRORS = {status: {"model": ErrorResponse, "description": text} for status, text in (
    (400, "bad input: what was expected"), (401, "no or another API key (--api-key)"),
    (404, "another model's name"), (408, "a body that did not arrive within --body-timeout"),
    (413, "a body over --max-request-bytes"),
    (503, "the queue is full (--max-queue) or the server is stopping: retry after Retry-After seconds"),
    (504, "not answered within --request-timeout"))}


@dataclass(slots=True, frozen=True)
class Limits:
    """What one request may ask and take, and how many may wait."""

    max_documents: int = 1024  # pairs per request
    max_request_bytes: int = 4 * 2**20
    max_queue: int = 256  # requests waiting for the engine
    body_timeout: float = 30.0  # seconds for a request's head, and again for its body, to arrive
    request_timeout: float = 600.0  # seconds from a request's body to its answer

    def __post_init__(self):
        for name in ("max_documents", "max_request_bytes", "max_queue"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        for name in ("body_timeout", "request_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def _body(model) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def create_app(scorer, served_name: str | None = None, limits: Limits = Limits(),
               api_key: str | None = None) -> FastAPI:
    """The app serving ``scorer`` as ``served_name`` (default: the model as the Scorer was given it); with ``api_key``,
    every route but /health needs ``Authorization: Bearer <api_key>``."""
    if scorer.num_labels != 1:
        raise ValueError(f"the scoring API needs a one-label model (num_labels == 1, as vLLM's); this one has "
                         f"{scorer.num_labels} labels ({', '.join(scorer.labels)})")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be a non-empty string (or None: no key)")
    if hasattr(scorer.tokenizer, "local_files"):  # a request's text must not make the server look for a file
        scorer.tokenizer.local_files = False
    name, started, metrics = served_name or scorer.config.model, int(time.time()), Metrics()

    @asynccontextmanager
    async def lifespan(app):  # a worker and a counter per run of the server
        state.batcher = Batcher(scorer, max_queue=limits.max_queue, on_call=metrics.on_call)
        state.counter = TokenCounter(scorer)
        metrics.queue.set_function(lambda: state.batcher.queued)
        state.batcher.start()
        try:
            yield
        finally:
            state.batcher.close()
            state.counter.close()

    app = FastAPI(title="xenc_lab", summary="cross-encoder scores and reranking in vLLM's API shapes",
                  lifespan=lifespan)
    state = app.state
    state.limits, state.metrics = limits, metrics
    state.http_protocol = timed_protocol(metrics, limits.body_timeout)  # for uvicorn (server.config_for)

    @app.exception_handler(ApiError)
    async def _api_error(request, err: ApiError):
        return JSONResponse(error_body(err.status, err.message), err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, err: RequestValidationError):
        return JSONResponse(error_body(400, describe(err.errors())), 400)

    @app.exception_handler(HTTPException)
    async def _http(request, err: HTTPException):
        return JSONResponse(error_body(err.status_code, str(err.detail)), err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def _crash(request, err: Exception):  # a server fault, logged with its traceback by the server
        return JSONResponse(error_body(500, f"internal error: {type(err).__name__}"), 500)

    def max_length_of(n: int | None) -> int | None:
        """truncate_prompt_tokens as vLLM reads it, checked against the model (None: the Scorer's max_length)."""
        limit = scorer.max_length
        if n is None or n == -1 or n == limit:
            return None
        if n > limit:
            raise ApiError(400, f"truncate_prompt_tokens value ({n}) is greater than max_model_len ({limit}). Please, "
                                "select a smaller truncation size.")
        try:
            return scorer._call_max_length(n, None)  # the Scorer's own checks (special tokens, token budget)
        except (ValueError, TypeError) as err:
            raise ApiError(400, f"truncate_prompt_tokens: {err}") from None

    async def answer_or_gone(request: Request, future) -> object:
        """The future's result, unless the client disconnects first (uvicorn's receive() returns then)."""
        result, gone = asyncio.wrap_future(future), asyncio.ensure_future(request.receive())
        try:
            done, _ = await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if result not in done:
            result.cancel()  # and with it the queued request: no call scores it
            raise ApiError(400, "Client disconnected")
        return result.result()

    async def scored(request: Request, kind: type[Options]):
        """The request's parsed body, its pairs' scores (float32) and tokens, or an ApiError."""
        parsed: Parsed = await run_in_threadpool(parse, await request.body(), request.headers.get("content-type"),
                                                 kind, limits.max_documents, max_length_of)
        body = parsed.body
        if body.model is not None and body.model != name:
            raise ApiError(404, f"The model `{body.model}` does not exist.")
        try:
            future = state.batcher.submit(parsed.pairs, parsed.max_length, body.activation_on(), body.truncation_side,
                                          body.cache_salt)
        except QueueFull as err:
            raise ApiError(503, f"the server is busy: {err}; retry later", {"Retry-After": "1"}) from None
        except Unavailable as err:
            raise ApiError(503, str(err), {"Retry-After": "1"}) from None
        try:
            tokens = await asyncio.wrap_future(state.counter.submit(parsed.pairs, parsed.max_length,
                                                                    body.truncation_side))
            scores = await answer_or_gone(request, future)
        except (ValueError, TypeError) as err:
            raise ApiError(400, str(err)) from None
        except Unavailable as err:
            raise ApiError(503, str(err), {"Retry-After": "1"}) from None
        finally:
            future.cancel()  # a request given up (an error, a client gone, its deadline) leaves the queue
        if state.batcher.counted is False:  # the Scorer does not count what it ran: it ran every token
            metrics.computed.inc(tokens)
        request.scope.setdefault("xenc", {}).update(pairs=len(parsed.pairs), tokens=tokens)
        return body, scores, tokens

    def response_id(request: Request, body: Options, kind: str) -> str:
        given = request.headers.get("x-request-id") or body.request_id
        return f"{kind}-{given}" if given else new_id(kind)

    async def score(request: Request) -> ScoreResponse:
        body, scores, tokens = await scored(request, ScoreRequest)
        return ScoreResponse(id=response_id(request, body, "score"), model=name, usage=Usage(
            prompt_tokens=tokens, total_tokens=tokens), data=[ScoreData(index=i, score=float(s))
                                                              for i, s in enumerate(scores)])

    async def rerank(request: Request) -> RerankResponse:
        body, scores, tokens = await scored(request, RerankRequest)
        documents = [body.documents] if isinstance(body.documents, str) else body.documents
        order = sorted(range(len(documents)), key=lambda i: -scores[i])  # best first, ties in document order
        top = len(order) if not body.top_n else body.top_n
        results = [RerankResult(index=i, relevance_score=float(scores[i]),
                                document=RerankDocument(text=documents[i]) if body.return_documents else None)
                   for i in order[:top]]
        return RerankResponse(id=response_id(request, body, "rerank"), model=name, results=results,
                              usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens))

    for path in ("/score", "/v1/score"):
        app.post(path, response_model=ScoreResponse, responses=ERRORS, tags=["scoring"], openapi_extra=_body(
            ScoreRequest), summary="scores of text pairs (vLLM's score API: 1:1, 1:N, N:N)")(score)
    for path, api in (("/rerank", "Jina's"), ("/v1/rerank", "Jina's"), ("/v2/rerank", "Cohere's v2")):
        app.post(path, response_model=RerankResponse, responses=ERRORS, response_model_exclude_none=True,
                 tags=["scoring"], openapi_extra=_body(RerankRequest),
                 summary=f"documents reranked for a query ({api} rerank API, as vLLM serves it)")(rerank)

    @app.get("/health", responses={503: ERRORS[503]}, summary="200 while the engine's worker runs (open without a key)")
    async def health():
        if not state.batcher.alive:
            raise ApiError(503, "the engine's worker is not running", {"Retry-After": "1"})
        return Response(status_code=200)

    @app.get("/v1/models", response_model=ModelList, responses={401: ERRORS[401]}, summary="the one served model")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, created=started, root=name, max_model_len=scorer.max_length)])

    @app.get("/metrics", responses={200: {"content": {metrics.content_type: {}}}, 401: ERRORS[401]},
             response_class=Response, summary="the server's metrics in Prometheus' text format")
    async def prometheus():
        return Response(metrics.text(), media_type=metrics.content_type)

    _schemas_in_openapi(app, ScoreRequest, RerankRequest)
    app.add_middleware(Deadline, seconds=limits.request_timeout, on_timeout=metrics.timeouts.labels("request").inc)
    app.add_middleware(BodyReader, max_bytes=limits.max_request_bytes, timeout=limits.body_timeout,
                       on_timeout=metrics.timeouts.labels("body").inc)
    if api_key is not None:
        app.add_middleware(ApiKey, key=api_key)
    app.add_middleware(AccessLog, metrics=metrics, routes={route.path for route in app.routes})  # the outermost
    return app


def _schemas_in_openapi(app: FastAPI, *models) -> None:
    """The request bodies (parsed by the handlers themselves, off the event loop) in the OpenAPI schema's components."""
    made = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = made()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
        return app.openapi_schema

    app.openapi = openapi
