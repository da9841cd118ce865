"""A request body read into its pairs and options, on a worker thread (never the event loop), in time linear in its
size: JSON, then the limits on counts (before any item is looked at), then the fields vLLM's APIs know elsewhere and
this server refuses, then the typed fields (pydantic, strict), then the pairing. Unknown fields are ignored with a
warning that names them, as vLLM's server does (its ``OpenAIBaseModel`` allows extra fields and logs them)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from pydantic import ValidationError

from .errors import ApiError, describe
from .schemas import SCORE_SIDES, Options, RerankRequest, ScoreRequest, Texts

logger = logging.getLogger("xenc_lab.serve")

# Fields of neighbouring APIs (vLLM's other pooling and scoring endpoints, TEI, Cohere v1) that would change the scores
# if honoured: refused by name rather than ignored.
REFUSED = {
    "normalize": "vLLM removed it; use use_activation",
    "label_token_ids": "label-token probabilities are not served, only the reranker's own scores",
    "apply_softmax": "label-token probabilities are not served; use use_activation",
    "item_first": "label-token scoring is not served",
    "chat_template": "the model's prompt format is fixed at start",
    "chat_template_kwargs": "the model's prompt format is fixed at start",
    "raw_scores": "use use_activation: false for raw logits",
    "truncation_direction": "use truncation_side",
    "max_chunks_per_doc": "documents are not split into chunks",
    "rank_fields": "documents are texts",
}
SIDE_FIELDS = {ScoreRequest: sorted({n for pair in SCORE_SIDES for n in pair}), RerankRequest: ["documents"]}


@dataclass(slots=True, frozen=True)
class Parsed:
    body: Options
    pairs: list[tuple[str, str]]
    max_length: int | None  # None: the Scorer's own


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


def _json(raw: bytes, content_type: str | None) -> dict:
    if content_type and "json" not in content_type.lower():
        raise ApiError(400, f"expected a JSON object (Content-Type: application/json); got {content_type[:60]}")
    if not raw.strip():
        raise ApiError(400, "expected a JSON object (Content-Type: application/json); the body is empty")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ApiError(400, f"the body is not valid JSON ({err.msg} at character {err.pos})") from None
    except (ValueError, RecursionError) as err:  # a number of over 4300 digits; arrays nested too deep
        raise ApiError(400, f"the body is not valid JSON for this API ({type(err).__name__}: "
                            f"{str(err)[:120]})") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"expected a JSON object (Content-Type: application/json); got a {type(data).__name__}")
    return data


def parse(raw: bytes, content_type: str | None, kind: type[Options], max_documents: int, check_length) -> Parsed:
    """The request ``kind`` (ScoreRequest or RerankRequest) in ``raw``, or an ApiError saying what is wrong.
    ``check_length(truncate_prompt_tokens)`` is the per-call max_length or raises ApiError."""
    data = _json(raw, content_type)
    for name in SIDE_FIELDS[kind]:
        if isinstance(data.get(name), list) and len(data[name]) > max_documents:
            raise ApiError(400, f"at most {max_documents} documents (pairs) per request (--max-documents); got "
                                f"{len(data[name])} in {name}")
    if refused := [name for name in REFUSED if name in data]:
        raise ApiError(400, "; ".join(f"{name} is not supported by this server ({REFUSED[name]})" for name in refused))
    if unknown := [name for name in data if name not in kind.model_fields]:
        shown = ", ".join(repr(name[:40]) for name in unknown[:10]) + (" ..." if len(unknown) > 10 else "")
        logger.warning("The following fields were present in the request but ignored: %s", shown)
    try:
        body = kind.model_validate(data)
    except ValidationError as err:
        raise ApiError(400, describe(err.errors(include_url=False, include_input=False))) from None
    if isinstance(body, RerankRequest):
        pairs = pair_up(body.query, [body.documents] if isinstance(body.documents, str) else body.documents,
                        max_documents)
    else:
        pairs = pair_up(*body.sides(), max_documents)
    return Parsed(body, pairs, check_length(body.truncate_prompt_tokens))
