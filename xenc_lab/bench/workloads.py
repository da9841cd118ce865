"""Offline, deterministic (query, passage) workloads for demos and benchmarks.

Texts are word sequences drawn from a fixed English vocabulary, so lengths, not meaning, are what they
model: ``short`` is MS MARCO-like, ``mixed`` has a tail past 512 tokens, ``long`` sits near 512.
"""
from __future__ import annotations

import csv
import json
import random

_VOCAB = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no will more can about said "
    "what out up its into them than only other new some could time these two may first then do any like "
    "my now over such our man me even most made after also did many before must through back years where "
    "much your way well down should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three river mountain "
    "protein gene market court election planet ocean algorithm database passage query everest python climate "
    "vaccine theorem museum recipe battery satellite history science energy water city music health "
    "language school system network computer engine island forest bridge century empire physics chemistry "
    "economy university hospital company product research model data result method study analysis process "
    "temperature pressure velocity population species evolution molecule cell tissue orbit galaxy telescope "
    "dynasty treaty parliament constitution republic festival cathedral volcano glacier desert rainfall"
).split()

WORKLOADS = ("short", "mixed", "long")


def _text(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(_VOCAB) for _ in range(n_words)]
    if words:
        words[0] = words[0].capitalize()
    return " ".join(words)


def make_pairs(kind: str = "mixed", n: int = 1000, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (query, passage) pairs of the given kind: 'short', 'mixed' or 'long'."""
    if kind not in WORKLOADS:
        raise ValueError(f"kind must be one of {WORKLOADS}, got {kind!r}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    rng = random.Random(f"{kind}-{seed}")
    pairs = []
    for _ in range(n):
        if kind == "short":
            q, d = rng.randint(5, 15), rng.randint(50, 100)
        elif kind == "long":
            q, d = rng.randint(5, 15), rng.randint(470, 560)
        else:
            q = rng.randint(4, 20)
            u = rng.random()
            d = rng.randint(10, 60) if u < 0.5 else rng.randint(60, 250) if u < 0.85 else rng.randint(250, 600)
        pairs.append((_text(rng, q) + "?", _text(rng, d) + "."))
    return pairs


QUERY_COLUMNS = ("query", "text_1", "question", "sentence1", "anchor")
PASSAGE_COLUMNS = ("passage", "document", "text_2", "doc", "text", "sentence2", "positive", "answer", "context",
                   "response", "documents", "passages")
NEGATIVE_COLUMNS = ("negative", "negatives")  # beside a passage field: more passages for the same query


def _pairs_from_columns(row: dict, where: str) -> list[tuple[str, str]]:
    """The (query, passage) pairs of one record: its passage field, then its negatives, each a string or (in JSON)
    a list of strings, one pair each."""
    query = next((c for c in QUERY_COLUMNS if c in row), None)
    passage = next((c for c in PASSAGE_COLUMNS if c in row), None)
    if query is None or passage is None:
        raise ValueError(
            f"{where}: expected a query field (one of {QUERY_COLUMNS}) and a passage field "
            f"(one of {PASSAGE_COLUMNS}), got fields {sorted(row)}"
        )
    passages = []
    for field in (passage, *(c for c in NEGATIVE_COLUMNS if c in row)):
        value = row[field]
        passages += value if isinstance(value, list) else [value]
    pairs = [(row[query], text) for text in passages]
    if not all(isinstance(text, str) for pair in pairs for text in pair):
        kinds = sorted({type(text).__name__ for pair in pairs for text in pair} - {"str"})
        raise ValueError(f"{where}: query and passage must be strings (a passage field may hold a list of them), got {', '.join(kinds)}")
    return pairs


def load_pairs(path) -> list[tuple[str, str]]:
    """(query, passage) pairs from a file, for benchmarking on a workload of one's own.

    - ``.jsonl``: one JSON object per line with a query field (``query``, ``text_1``, ``question``, ``sentence1``
      or ``anchor``) and a passage field (``passage``, ``document``, ``text_2``, ``doc``, ``text``, ``sentence2``,
      ``positive``, ``answer``, ``context``, ``response``, ``documents`` or ``passages``), or a two-element list
      ``[query, passage]``. A passage field may hold a list of passages (the /rerank shape: one query, many
      documents), and a ``negative`` or ``negatives`` field beside it more of them (sentence-transformers'
      (anchor, positive, negative) triplets): each passage makes a pair with the query, in that order.
    - ``.tsv`` / ``.csv``: a header naming those fields, or no header and two columns (query, passage) or four
      (qid, pid, query, passage, as MS MARCO's top-1000 files: the first two are integer ids). A ``.tsv`` is read
      as MS MARCO's files are written: quotes are text, not quoting. A ``.csv`` follows csv quoting.

    A UTF-8 byte-order mark is skipped. Every pair must be two strings; anything else, or a file that cannot be read
    as UTF-8 text, is a ValueError naming the file (and the line). A header naming no known field is read as a pair.
    """
    from pathlib import Path

    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".tsv", ".csv"):
        raise ValueError(f"{path}: expected a .jsonl, .tsv or .csv file, got {suffix or 'no suffix'!r}")
    limit = csv.field_size_limit()
    csv.field_size_limit(1 << 30)  # a passage may be a whole document: csv's default stops fields at 128 KiB
    try:
        pairs = _read_pairs(path, suffix)
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise ValueError(f"{path}: {err}") from err
    finally:
        csv.field_size_limit(limit)
    if not pairs:
        raise ValueError(f"{path}: no pairs found")
    return pairs


def _read_pairs(path, suffix: str) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    with path.open(encoding="utf-8-sig", newline="") as f:
        if suffix == ".jsonl":
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
                if isinstance(item, dict):
                    pairs += _pairs_from_columns(item, f"{path}:{n}")
                elif isinstance(item, list) and len(item) == 2:
                    pairs += _pairs_from_columns({"query": item[0], "passage": item[1]}, f"{path}:{n}")
                else:
                    raise ValueError(f"{path}:{n}: expected an object or a [query, passage] list, got {line.strip()[:80]!r}")
        else:
            options = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if suffix == ".tsv" else {"delimiter": ","}
            rows = list(csv.reader(f, **options))
            header = [c.strip().lower() for c in rows[0]] if rows else []
            named = any(c in header for c in QUERY_COLUMNS) and any(c in header for c in PASSAGE_COLUMNS)
            for n, row in enumerate(rows[1:] if named else rows, 2 if named else 1):
                if not row:
                    continue
                if named:
                    if len(row) != len(header):
                        raise ValueError(f"{path}:{n}: expected {len(header)} fields as in the header, got {len(row)}")
                    pairs += _pairs_from_columns(dict(zip(header, row)), f"{path}:{n}")
                elif len(row) == 2:
                    pairs.append((row[0], row[1]))
                elif len(row) == 4 and row[0].strip().isdigit() and row[1].strip().isdigit():
                    pairs.append((row[2], row[3]))
                else:
                    raise ValueError(
                        f"{path}:{n}: expected two columns (query, passage), four (qid, pid, query, passage: integer "
                        f"ids first), or a header naming them, got {len(row)} columns"
                    )
    return pairs
