"""Long documents (``long_documents="max"`` or ``"mean"``): a pair whose text_2 overflows max_length becomes several
rows, windows of text_2's tokens beside the pair's text_1, scored in the same engine call as every other row; the
windows' scores (after the activation) are then aggregated per pair, their max or their mean.

The first window is the truncated pair itself, the ids truncation makes, and the engine batches the pairs' first
windows as it batches the truncated pairs (``engine.run_order``): "max" is never below "truncate", and "first" (the
first window's score) is "truncate", so that mode makes no further windows. Each next window starts ``stride`` tokens
further into text_2 (default: half a window) and holds as many tokens as the first; the last one reaches text_2's
end. Window boundaries are text_2's own token boundaries:

- a text pair (``PairTokenizer``): text_2 is encoded alone, as the pair's tokenization encodes it, and each window
  is laid out with the truncated text_1 by the tokenizer's ``PairLayout`` (special tokens, token type ids);
- a chat template (``ChatPairTokenizer``): the render's ids before the document (template and query, as far as a
  render with an empty document has the same ids), a slice of the document's ids, then the suffix that truncation
  writes back, so that every window ends in the template's verdict cue as a truncated row does.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .config import ScorerConfig, long_documents_mode, stride_of
from .decoder.chat import ChatPairTokenizer
from .tokenize import Encodings, PairTokenizer, first_rows, longest_first


def spans(n: int, width: int, stride: int | None = None, from_left: bool = False) -> list[tuple[int, int]]:
    """(start, stop) of the windows over ``n`` tokens, ``width`` tokens each: the first is the truncated pair's (the
    first ``width`` tokens, the last ones where truncation keeps the end); each next one starts ``stride`` tokens on
    (None: half a window; at most a window, so that no token is skipped), and the last reaches the far end."""
    if n <= width or width <= 0:
        keep = max(0, min(n, width))
        return [(n - keep, n) if from_left else (0, keep)]
    step = min(stride if stride is not None else max(1, width // 2), width)
    last = -(-(n - width) // step) * step  # the first start whose window reaches the end
    out = [(a, min(a + width, n)) for a in range(0, last + 1, step)]
    return [(n - b, n - a) for a, b in out] if from_left else out


def windowed_pairs(tokenizer, text_1: list[str], text_2: list[str], max_length: int | None = None, *,
                   stride: int | None = None, prompt: str | None = None) -> Encodings:
    """The pairs' windows as rows (``owner``: the pair of each row, its first window first), cut to ``max_length``
    tokens (default: the tokenizer's); ``prompt``: a chat template's system message."""
    assert len(text_1) == len(text_2), (len(text_1), len(text_2))
    max_length = tokenizer.max_length if max_length is None else max_length
    if isinstance(tokenizer, ChatPairTokenizer):
        return _chat_windows(tokenizer, text_1, text_2, max_length, stride, prompt or None)
    return _pair_windows(tokenizer, text_1, text_2, max_length, stride)


def _pair_windows(tok: PairTokenizer, text_1, text_2, max_length: int, stride: int | None) -> Encodings:
    """Text pairs: text_1 cut as the pair's truncation cuts it, beside each window of text_2 (as wide as the
    truncated pair's text_2), laid out by the tokenizer's PairLayout."""
    layout = tok.layout
    assert layout is not None, "long documents need a fixed pair layout (checked by check_supported)"
    budget = max_length - tok.specials
    from_left = tok.tokenizer.truncation_side == "left"
    firsts = tok.backend.encode_batch(text_1, add_special_tokens=False)
    seconds = tok.backend.encode_batch(text_2, add_special_tokens=False)
    rows, kept, owner = [], [], []
    for i, (first, second) in enumerate(zip(firsts, seconds)):
        ids_1, ids_2 = first.ids, second.ids
        keep_1, keep_2 = longest_first(len(ids_1), len(ids_2), budget)
        query = ids_1[len(ids_1) - keep_1 :] if from_left else ids_1[:keep_1]
        for a, b in spans(len(ids_2), keep_2, stride, from_left):
            rows.append(layout.ids(query, ids_2[a:b]))
            kept.append((keep_1, b - a))
            owner.append(i)
    enc = Encodings.from_rows(rows)
    if tok.emits_token_type_ids:
        enc.type_ids = layout.type_ids(np.array(kept, dtype=np.int64).reshape(-1, 2))
    enc.owner = np.array(owner, dtype=np.int64)
    return enc


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _chat_windows(tok: ChatPairTokenizer, text_1, text_2, max_length: int, stride: int | None,
                  prompt: str | None) -> Encodings:
    """Chat renders: a row that overflows is the truncated row first, then the render's ids before the document, a
    slice of the document's ids as wide as the truncated row holds, and the suffix truncation writes back."""
    assert tok.tokenizer.truncation_side != "left", "checked by check_supported"
    conversations, full = tok.rendered(text_1, text_2, prompt)
    suffix = tok.suffix(prompt) if tok.restore_suffix else []
    long = [i for i, ids in enumerate(full) if len(ids) > max_length]
    bare = dict(zip(long, tok.rendered([text_1[i] for i in long], [""] * len(long), prompt)[1]))
    rows, owner = [], []
    for i, ids in enumerate(full):
        rows.append(tok.cut(ids, max_length, suffix, conversations[i]))
        owner.append(i)
        if i not in bare:
            continue
        # The document is the render's ids between those it shares with the empty document's render at each end.
        start = _common_prefix(ids, bare[i])
        tail = min(_common_prefix(ids[::-1], bare[i][::-1]), min(len(ids), len(bare[i])) - start)
        body = ids[start : len(ids) - tail]
        written = suffix[max(0, len(suffix) - max_length) :] if suffix and tok.text_only(conversations[i]) else []
        width = max_length - len(written) - start  # the document's ids the truncated row holds
        for a, b in spans(len(body), width, stride)[1:]:
            rows.append(ids[:start] + body[a:b] + written)
            owner.append(i)
    enc = Encodings.from_rows(rows)
    if tok.emits_token_type_ids:
        enc.type_ids = np.zeros_like(enc.ids)
    enc.owner = np.array(owner, dtype=np.int64)
    return enc


def pair_scores(logits: torch.Tensor, owner: np.ndarray, mode: str, to_scores: Callable) -> torch.Tensor:
    """(rows, 1) window logits of pairs whose rows ``owner`` names -> (pairs,) scores: the windows' scores by
    ``to_scores`` (the activation), aggregated per pair by ``mode``, "max" or "mean"."""
    return aggregate(window_scores(logits, owner, to_scores), owner, int(first_rows(owner).sum()), mode)


def window_scores(logits: torch.Tensor, owner: np.ndarray, to_scores: Callable) -> torch.Tensor:
    """(rows, 1) window logits -> (rows,) scores by ``to_scores``, the first windows' as one tensor (the truncated
    pairs' logits, activated as "truncate" activates them: an activation's vector code may round by position), the
    other windows' apart."""
    first = torch.from_numpy(first_rows(owner))
    parts = [(rows, to_scores(logits[rows])) for rows in (first, ~first) if rows.any()]
    scores = torch.empty(len(owner), dtype=parts[0][1].dtype if parts else torch.float32)
    for rows, part in parts:
        scores[rows] = part
    return scores


def aggregate(scores: torch.Tensor, owner: np.ndarray, n: int, mode: str) -> torch.Tensor:
    """(rows,) window scores -> (n,) pair scores: each pair's highest ("max") or their mean ("mean", summed in
    float64)."""
    assert scores.ndim == 1 and len(scores) == len(owner), (tuple(scores.shape), len(owner))
    index = torch.from_numpy(owner)
    if mode == "max":
        empty = torch.full((n,), float("-inf"), dtype=scores.dtype)
        return empty.scatter_reduce(0, index, scores, "amax", include_self=False)
    assert mode == "mean", mode
    sums = torch.zeros(n, dtype=torch.float64).index_add_(0, index, scores.double())
    return (sums / torch.bincount(index, minlength=n)).to(scores.dtype)


def check_supported(tokenizer, num_labels: int, mode: str) -> None:
    """Refuse, saying why, a long_documents mode other than "truncate" where windows cannot be made as promised."""
    if mode in ("truncate", "first"):  # "first" is the truncated pair: no further windows are made
        return
    if num_labels != 1:
        raise ValueError(
            f"long_documents={mode!r} needs a one-label model: a pair's windows are aggregated into one score; this "
            f"model has {num_labels} labels. Use long_documents='truncate'")
    side = tokenizer.tokenizer.truncation_side
    if isinstance(tokenizer, ChatPairTokenizer):
        if side == "left":
            raise ValueError(
                f"long_documents={mode!r} keeps the chat template's start and the query in every window, which this "
                "tokenizer's truncation_side='left' cuts first; use long_documents='truncate'")
    elif tokenizer.layout is None:
        why = "a slow tokenizer" if tokenizer.backend is None else "a tokenizer whose pair layout is not a fixed template"
        raise ValueError(
            f"long_documents={mode!r} lays windows of text_2's tokens out as the tokenizer lays out a pair, which "
            f"{why} does not allow (it truncates pairs itself); use long_documents='truncate'")


def call_mode(config: ScorerConfig, tokenizer, num_labels: int, mode, stride) -> tuple[str, int | None]:
    """A call's long_documents and window_stride (None: the Scorer's ``config``), checked."""
    mode = config.long_documents if mode is None else long_documents_mode(mode)
    stride = config.window_stride if stride is None else stride_of(stride)
    check_supported(tokenizer, num_labels, mode)
    return mode, stride
