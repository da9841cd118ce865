"""The HTTP API's request and response bodies, in vLLM's shapes (``/score``: vLLM's score API; ``/rerank``: Jina's and
Cohere's rerank APIs as vLLM serves them), as pydantic models: FastAPI validates requests with them and writes the
OpenAPI schema from them. Inputs are strict: a number is not a text and "true" is not a boolean."""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator


def _unicode(text: str) -> str:
    # JSON may escape a lone surrogate ("\\ud800"), which is no Unicode text: the tokenizer could not take it
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"expected Unicode text; character {err.start} is a lone surrogate "
                         f"({text[err.start]!r})") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]
Texts = Text | list[Text]

# The ways /score takes its two sides, in the order they are looked for.
SCORE_SIDES = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items"))


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def _off(name: str, off: object, why: str):
    """A check that refuses a field unless it holds ``off`` (vLLM's default, which is what this server does)."""
    def check(value):
        if value != off and value is not None:
            raise ValueError(f"{name}={repr(value)[:80]} is not supported by this server ({why}); leave it out or "
                             f"send {off!r}")
        return value
    return AfterValidator(check)


class Options(BaseModel):
    """What /score and /rerank requests share: vLLM's pooling request fields. Each is honoured as vLLM honours it or
    refused when set to anything but the value that does what this server does (docs/serving.md lists them)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = Field(None, description="the served model's name (GET /v1/models); another name gets 404")
    user: str | None = Field(None, description="accepted and ignored, as in OpenAI's APIs")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="truncate each pair to this many tokens (-1: the model's max_model_len); above "
                                 "max_model_len is refused. Default: the model's max_length, as sentence-transformers")
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="the side truncation cuts from: right keeps the first tokens, left the last (the pair's "
                          "longer text loses tokens first, special tokens stay). Default: the tokenizer's own")
    use_activation: bool | None = Field(
        None, description="true (default): scores through the model's activation, as CrossEncoder.predict (Identity "
                          "for ms-marco-style saves, else sigmoid for one label); false: raw logits")
    activation: bool | None = Field(None, description="deprecated: the old name of use_activation")
    softmax: bool | None = Field(None, description="deprecated: the old name of use_activation")
    request_id: Annotated[str, Field(max_length=256)] | None = Field(
        None, description="the response's id is '<score|rerank>-' and this (an X-Request-Id header wins, as in vLLM)")
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = Field(
        None, description="requests with different salts never share an engine call (nor a decoder's prefix)")
    priority: Annotated[int, _off("priority", 0, "no priority scheduling")] = 0
    padding: Annotated[Literal["max_length", "do_not_pad"] | None,
                       _off("padding", "do_not_pad", "pairs are never padded")] = None
    max_tokens_per_query: Annotated[int, _off("max_tokens_per_query", 0, "no per-side limits")] = 0
    max_tokens_per_doc: Annotated[int, _off("max_tokens_per_doc", 0, "no per-side limits")] = 0
    mm_processor_kwargs: Annotated[dict | None, _off("mm_processor_kwargs", None, "text only")] = None
    add_special_tokens: Annotated[bool, _off("add_special_tokens", True, "pairs always carry the model's "
                                             "special tokens, as vLLM's cross-encoder pairs")] = True

    def activation_on(self) -> bool:
        """vLLM's rule: use_activation, else its old names, else on."""
        for value in (self.use_activation, self.activation, self.softmax):
            if value is not None:
                return value
        return True


class ScoreRequest(Options):
    """Two sides paired 1:1, 1:N (the first side one text) or N:N: ``text_1``/``text_2``, ``data_1``/``data_2``,
    ``queries``/``documents`` or ``queries``/``items``; each side a text or a list of texts."""

    text_1: Texts | None = None
    text_2: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None

    @model_validator(mode="after")
    def _one_pair_of_sides(self):
        given = [(a, b) for a, b in SCORE_SIDES if getattr(self, a) is not None and getattr(self, b) is not None]
        named = {n for pair in SCORE_SIDES for n in pair if getattr(self, n) is not None}
        if len(given) != 1 or named != set(given[0]):
            raise ValueError("expected exactly one pair of sides: text_1 and text_2, data_1 and data_2, queries and "
                             f"documents, or queries and items; got {', '.join(sorted(named)) or 'none'}")
        return self

    def sides(self) -> tuple[Texts, Texts]:
        return next((getattr(self, a), getattr(self, b)) for a, b in SCORE_SIDES if getattr(self, a) is not None
                    and getattr(self, b) is not None)


class RerankRequest(Options):
    """Jina's rerank request (and Cohere's v2): one query, its documents, the top_n to return."""

    query: Text
    documents: Texts
    top_n: int | None = Field(0, ge=0, description="results to return, best first; 0 (or null): all. Negative is "
                                                   "refused, as vLLM refuses it")
    return_documents: bool = Field(True, description="echo each document's text in its result, as vLLM always does")


class Usage(BaseModel):
    """Tokens of the pairs as the model ran them: truncated, with the special tokens (or the chat template)."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: Usage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("rerank"))
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "xenc_lab"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """vLLM's error body: ``{"error": {"message", "type", "param", "code"}}``, code the HTTP status."""

    error: ErrorInfo
