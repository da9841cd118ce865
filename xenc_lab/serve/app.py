"""The HTTP app: vLLM's scoring routes (``/score``, ``/v1/score``, ``/rerank``, ``/v1/rerank``, ``/v2/rerank``) and
``/health``, ``/v1/models``, over one Scorer whose model is fixed at start.

A request is checked (model name, options, sizes), queued on the batcher (which shares ``predict`` calls between
clients) and counted on the token counter's thread meanwhile; nothing of the engine runs on the event loop. Client
input never gets a 5xx: bad input is 400 (404 for another model's name, 413 for a body over the limit) and a full
queue 503 with Retry-After.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from .batcher import Batcher, QueueFull
from .errors import ApiError, BodyLimit, describe, error_body
from .schemas import (ErrorResponse, ModelCard, ModelList, Options, RerankDocument, RerankRequest, RerankResponse,
                      RerankResult, RerankUsage, ScoreData, ScoreRequest, ScoreResponse, Texts, Usage, new_id)
from .usage import TokenCounter

logger = logging.getLogger(__name__)
ERRORS = {status: {"model": ErrorResponse, "description": text} for status, text in (
    (400, "bad input: what was expected"), (404, "another model's name"), (413, "a body over --max-request-bytes"),
    (503, "the queue is full (--max-queue): retry after Retry-After seconds"))}


@dataclass(slots=True, frozen=True)
class Limits:
    """What one request may ask and how many may wait."""

    max_documents: int = 1024  # pairs per request
    max_request_bytes: int = 4 * 2**20
    max_queue: int = 256  # requests waiting for the engine

    def __post_init__(self):
        for name in ("max_documents", "max_request_bytes", "max_queue"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")


def pair_up(first: Texts, second: Texts, max_documents: int) -> list[tuple[str, str]]:
    """vLLM's pairing: 1:1, 1:N (the first side one text, repeated) or N:N; at most ``max_documents`` pairs."""
    a = [first] if isinstance(first, str) else first
    b = [second] if isinstance(second, str) else second
    if not a or not b:
        raise ApiError(400, f"both sides need at least one text; got {len(a)} and {len(b)}")
    if len(a) != 1 and len(a) != len(b):
        raise ApiError(400, f"Input lengths must be either 1:1, 1:N or N:N; got {len(a)} and {len(b)}")
    if len(b) > max_documents:
        raise ApiError(400, f"at most {max_documents} documents (pairs) per request (--max-documents); got {len(b)}")
    return list(zip(a * len(b) if len(a) == 1 else a, b))


def create_app(scorer, served_name: str | None = None, limits: Limits = Limits()) -> FastAPI:
    """The app serving ``scorer`` as ``served_name`` (default: the model as the Scorer was given it)."""
    if scorer.num_labels != 1:
        raise ValueError(f"the scoring API needs a one-label model (num_labels == 1, as vLLM's); this one has "
                         f"{scorer.num_labels} labels ({', '.join(scorer.labels)})")
    if hasattr(scorer.tokenizer, "local_files"):  # a request's text must not make the server look for a file
        scorer.tokenizer.local_files = False
    name, started = served_name or scorer.config.model, int(time.time())

    @asynccontextmanager
    async def lifespan(app):  # a worker and a counter per run of the server
        state.batcher, state.counter = Batcher(scorer, max_queue=limits.max_queue), TokenCounter(scorer)
        state.batcher.start()
        try:
            yield
        finally:
            state.batcher.close()
            state.counter.close()

    app = FastAPI(title="xenc_lab", summary="cross-encoder scores and reranking in vLLM's API shapes",
                  lifespan=lifespan)
    state = app.state
    state.limits = limits
    app.add_middleware(BodyLimit, max_bytes=limits.max_request_bytes)

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

    def max_length_of(body: Options) -> int | None:
        """truncate_prompt_tokens as vLLM reads it, checked against the model (None: the Scorer's max_length)."""
        n, limit = body.truncate_prompt_tokens, scorer.max_length
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

    async def scores_of(body: Options, pairs: list[tuple[str, str]], request: Request):
        """The pairs' scores (float32) and their tokens, or an ApiError."""
        max_length = max_length_of(body)
        try:
            future = state.batcher.submit(pairs, max_length, body.activation_on())
        except QueueFull as err:
            raise ApiError(503, f"the server is busy: {err}; retry later", {"Retry-After": "1"}) from None
        except RuntimeError as err:
            raise ApiError(503, str(err), {"Retry-After": "1"}) from None
        try:
            tokens = await asyncio.wrap_future(state.counter.submit(pairs, max_length))
            return await answer_or_gone(request, future), tokens
        except (ValueError, TypeError) as err:
            raise ApiError(400, str(err)) from None
        finally:
            future.cancel()  # a request given up (an error, a client gone) leaves the queue

    def check_model(body: Options) -> None:
        if body.model is not None and body.model != name:
            raise ApiError(404, f"The model `{body.model}` does not exist.")

    def request_id(request: Request, kind: str) -> str:
        given = request.headers.get("x-request-id")
        return f"{kind}-{given}" if given else new_id(kind)

    async def score(body: ScoreRequest, request: Request) -> ScoreResponse:
        check_model(body)
        scores, tokens = await scores_of(body, pair_up(*body.sides(), limits.max_documents), request)
        return ScoreResponse(id=request_id(request, "score"), model=name, usage=Usage(prompt_tokens=tokens,
                             total_tokens=tokens), data=[ScoreData(index=i, score=float(s)) for i, s in enumerate(scores)])

    async def rerank(body: RerankRequest, request: Request) -> RerankResponse:
        check_model(body)
        documents = [body.documents] if isinstance(body.documents, str) else body.documents
        scores, tokens = await scores_of(body, pair_up(body.query, documents, limits.max_documents), request)
        order = sorted(range(len(documents)), key=lambda i: -scores[i])  # best first, ties in document order
        top = len(order) if body.top_n is None or body.top_n <= 0 else body.top_n
        results = [RerankResult(index=i, relevance_score=float(scores[i]),
                                document=RerankDocument(text=documents[i]) if body.return_documents else None)
                   for i in order[:top]]
        return RerankResponse(id=request_id(request, "rerank"), model=name, results=results,
                              usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens))

    for path in ("/score", "/v1/score"):
        app.post(path, response_model=ScoreResponse, responses=ERRORS, tags=["scoring"],
                 summary="scores of text pairs (vLLM's score API: 1:1, 1:N, N:N)")(score)
    for path, api in (("/rerank", "Jina's"), ("/v1/rerank", "Jina's"), ("/v2/rerank", "Cohere's v2")):
        app.post(path, response_model=RerankResponse, responses=ERRORS, response_model_exclude_none=True,
                 tags=["scoring"], summary=f"documents reranked for a query ({api} rerank API, as vLLM serves it)")(rerank)

    @app.get("/health", responses={503: ERRORS[503]}, summary="200 while the engine's worker runs")
    async def health():
        if not state.batcher.alive:
            raise ApiError(503, "the engine's worker is not running", {"Retry-After": "1"})
        return Response(status_code=200)

    @app.get("/v1/models", response_model=ModelList, summary="the one served model")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, created=started, root=name, max_model_len=scorer.max_length)])

    return app
