"""Reading and writing the files of a reranking experiment: TREC runs and qrels, BEIR's JSONL and TSV, MS MARCO's
TSVs, and DataFrames. Every reader names the file and the line of what it cannot parse."""
from __future__ import annotations

import gzip
import io
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping

RUN_COLUMNS = ["qid", "docno", "rank", "score"]
QRELS_COLUMNS = ["qid", "docno", "relevance"]


class FormatError(ValueError):
    """A line of an input file is not what its format says; the message names the file and the line."""

    def __init__(self, path, line_no: int, expected: str, line: str):
        shown = line if len(line) <= 120 else line[:117] + "..."
        super().__init__(f"{os.fspath(path)}, line {line_no}: expected {expected}, got {shown!r}")


def _open(path) -> io.TextIOBase:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path}")
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def _lines(path) -> Iterator[tuple[int, str]]:
    """(line number, line without its newline) for each non-blank line."""
    with _open(path) as f:
        for no, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if line.strip():
                yield no, line


def _pandas():
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover - pandas comes with the 'ir' extra
        raise ImportError("xenc_lab's experiment tools need pandas: pip install 'xenc-lab[ir]'") from None
    return pd


def _is_frame(value) -> bool:
    return type(value).__module__.startswith("pandas") and type(value).__name__ == "DataFrame"


def _frame_columns(frame, wanted: dict[str, tuple[str, ...]], what: str):
    """The frame's column for each wanted name, accepting the field's other names for it (``_id``, ``query_id``...)."""
    found = {}
    for name, aliases in wanted.items():
        hit = next((c for c in (name, *aliases) if c in frame.columns), None)
        if hit is None:
            raise ValueError(f"{what} frame needs a column {name!r} (or one of {list(aliases)}); it has "
                             f"{list(frame.columns)}")
        found[name] = hit
    return found


# -- runs ---------------------------------------------------------------------------------------------------
def read_run(source):
    """A first-stage or reranked run as a DataFrame (qid, docno, rank, score): a TREC run file (``qid Q0 docno rank
    score tag``, gzip too) or a DataFrame with those columns (``query_id``/``doc_id`` accepted). Rows keep the file's
    order; a (qid, docno) pair given twice is refused, as trec_eval refuses it."""
    pd = _pandas()
    if _is_frame(source):
        cols = _frame_columns(source, {"qid": ("query_id",), "docno": ("doc_id",), "score": ()}, "a run")
        frame = pd.DataFrame({"qid": source[cols["qid"]].astype(str), "docno": source[cols["docno"]].astype(str),
                              "score": source[cols["score"]].astype("float64")})
        if "rank" in source.columns:
            frame.insert(2, "rank", source["rank"].astype("int64").to_numpy())
        else:
            frame.insert(2, "rank", frame.groupby("qid", sort=False).cumcount() + 1)
        where = "the run frame"
    else:
        qids, docnos, ranks, scores = [], [], [], []
        for no, line in _lines(source):
            parts = line.split()
            try:
                if len(parts) != 6:
                    raise ValueError
                rank, score = int(parts[3]), float(parts[4])
            except ValueError:
                raise FormatError(source, no, "6 fields 'qid Q0 docno rank score tag' with an integer rank and a "
                                  "numeric score", line) from None
            qids.append(parts[0])
            docnos.append(parts[2])
            ranks.append(rank)
            scores.append(score)
        frame = pd.DataFrame({"qid": qids, "docno": docnos, "rank": pd.array(ranks, dtype="int64"),
                              "score": pd.array(scores, dtype="float64")})
        where = os.fspath(source)
    dup = frame.duplicated(["qid", "docno"])
    if dup.any():
        shown = [f"{q}/{d}" for q, d in frame.loc[dup, ["qid", "docno"]].head(5).itertuples(index=False)]
        raise ValueError(f"{where}: {int(dup.sum())} (qid, docno) pairs appear more than once, e.g. {shown}")
    return frame.reset_index(drop=True)


def format_run_lines(qid: str, docnos: Iterable[str], scores: Iterable[float], tag: str) -> str:
    """One query's TREC run lines, ranks from 1 in the given order; scores written exactly (``repr``)."""
    return "".join(f"{qid} Q0 {d} {r} {float(s)!r} {tag}\n" for r, (d, s) in enumerate(zip(docnos, scores), 1))


def write_run(run, path, tag: str = "xenc_lab") -> None:
    """Writes a run frame (qid, docno, rank, score) as a TREC run file in its rank order per query."""
    frame = read_run(run) if not _is_frame(run) or "rank" not in run.columns else run
    check_tag(tag)
    frame = frame.sort_values(["qid", "rank"], kind="stable")
    with open(path, "w", encoding="utf-8") as f:
        for qid, group in frame.groupby("qid", sort=False):
            f.write(format_run_lines(qid, group["docno"], group["score"], tag))


def check_tag(tag) -> str:
    if not isinstance(tag, str) or not tag or any(c.isspace() for c in tag):
        raise ValueError(f"a run tag must be a non-empty str without spaces, got {tag!r}")
    return tag


# -- qrels --------------------------------------------------------------------------------------------------
def read_qrels(source):
    """Relevance judgements as a DataFrame (qid, docno, relevance): TREC qrels (``qid 0 docno rel``), BEIR's
    ``qrels/<split>.tsv`` (``query-id  corpus-id  score`` with its header), or a DataFrame (``qid, docno,
    relevance``; PyTerrier's ``label``, ir-measures' ``query_id, doc_id`` accepted)."""
    pd = _pandas()
    if _is_frame(source):
        cols = _frame_columns(source, {"qid": ("query_id", "query-id"), "docno": ("doc_id", "corpus-id"),
                                       "relevance": ("label", "score", "rel")}, "a qrels")
        return pd.DataFrame({"qid": source[cols["qid"]].astype(str), "docno": source[cols["docno"]].astype(str),
                             "relevance": source[cols["relevance"]].astype("int64")}).reset_index(drop=True)
    qids, docnos, rels = [], [], []
    for no, line in _lines(source):
        parts = line.split("\t") if "\t" in line else line.split()
        if no == 1 and len(parts) == 3 and parts[0].strip() == "query-id":
            continue  # BEIR's header
        try:
            if len(parts) == 4:  # TREC: qid iteration docno relevance
                qid, docno, rel = parts[0], parts[2], int(parts[3])
            elif len(parts) == 3:  # BEIR: query-id corpus-id score
                qid, docno, rel = parts[0], parts[1], int(parts[2])
            else:
                raise ValueError
        except ValueError:
            raise FormatError(source, no, "'qid 0 docno relevance' (TREC) or 'query-id<TAB>corpus-id<TAB>score' "
                              "(BEIR) with an integer relevance", line) from None
        qids.append(qid.strip())
        docnos.append(docno.strip())
        rels.append(rel)
    return pd.DataFrame({"qid": qids, "docno": docnos, "relevance": pd.array(rels, dtype="int64")})


# -- queries and documents ----------------------------------------------------------------------------------
def _read_texts(source, what: str, keep, title_sep, text_names=("text",)) -> dict[str, str]:
    """id -> text from BEIR JSONL (``_id``, ``text``, optional ``title``), a two-column TSV (``id<TAB>text``), a
    DataFrame or a mapping. ``keep``: only these ids (the rest is not held in memory); ``title_sep``: how a title
    joins its text (None: titles are left out)."""
    if isinstance(source, Mapping):
        items = ((str(k), v) for k, v in source.items())
        return {k: _joined(v, title_sep, what, k) for k, v in items if keep is None or k in keep}
    if _is_frame(source):
        cols = _frame_columns(source, {"id": ("_id", "docno", "qid", "pid", "doc_id", "query_id"),
                                       text_names[0]: text_names[1:]}, what)
        cols["text"] = cols[text_names[0]]
        titles = source["title"] if "title" in source.columns and title_sep is not None else None
        out = {}
        for i, (key, text) in enumerate(zip(source[cols["id"]].astype(str), source[cols["text"]])):
            if keep is None or key in keep:
                title = titles.iloc[i] if titles is not None else None
                out[key] = _joined({"text": text, "title": title}, title_sep, what, key)
        return out
    path = os.fspath(source)
    jsonl = path.removesuffix(".gz").endswith((".jsonl", ".json"))
    out = {}
    for no, line in _lines(path):
        if jsonl:
            try:
                row = json.loads(line)
                if not isinstance(row, dict) or "_id" not in row or not isinstance(row.get("text", ""), str):
                    raise ValueError
            except ValueError:
                raise FormatError(path, no, 'a JSON object with "_id" and a str "text" (BEIR)', line) from None
            key = str(row["_id"])
        else:
            key, sep, text = line.partition("\t")
            if not sep:
                raise FormatError(path, no, "'id<TAB>text' (MS MARCO)", line)
            row = {"text": text}
        if keep is None or key in keep:
            out[key] = _joined(row, title_sep, what, key)
    return out


def _joined(row, title_sep, what, key) -> str | None:
    if isinstance(row, str) or row is None:
        return row
    if not isinstance(row, Mapping):
        raise TypeError(f"{what} {key!r}: expected a str or a mapping with 'text', got {type(row).__name__}")
    text, title = row.get("text"), row.get("title")
    if text is not None and not isinstance(text, str):
        text = None if _missing(text) else str(text)
    if title_sep is not None and isinstance(title, str) and title:
        return f"{title}{title_sep}{text or ''}"  # BEIR's reranking: title, a space, text
    return text


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def read_queries(source) -> dict[str, str]:
    """qid -> text from BEIR's ``queries.jsonl``, MS MARCO's ``qid<TAB>query`` TSV, a DataFrame (PyTerrier's topics
    ``qid, query``; or ``_id``/``qid`` and ``text``) or a dict."""
    if _is_frame(source) and "query" in source.columns and "qid" in source.columns:
        return _read_texts(source[["qid", "query"]].drop_duplicates("qid"), "query", None, None, ("query",))
    return _read_texts(source, "query", None, None)


def read_corpus(source, ids: Iterable[str] | None = None, title_sep: str | None = " ") -> dict[str, str]:
    """docno -> text from BEIR's ``corpus.jsonl`` (title, ``title_sep``, text where a title exists), MS MARCO's
    ``pid<TAB>passage`` TSV, a DataFrame or a dict. ``ids``: keep only these documents (a run's candidates), so
    a large corpus streams through without being held."""
    if title_sep is not None and not isinstance(title_sep, str):
        raise TypeError(f"title_sep must be a str or None, got {type(title_sep).__name__}")
    return _read_texts(source, "document", None if ids is None else set(ids), title_sep)


def texts_of_run(run, queries, corpus):
    """(queries, corpus) with a missing one taken from a run frame's own text columns, as PyTerrier's results frames
    carry them: ``query`` (qid -> query) and ``text`` (docno -> document)."""
    for given, column, what in ((queries, "query", "queries"), (corpus, "text", "corpus")):
        if given is None and not (_is_frame(run) and column in run.columns):
            raise ValueError(f"{what} is None: give {what}, or a run DataFrame with a {column!r} column "
                             f"(PyTerrier's results frame)")
    if queries is None:
        queries = dict(zip(run["qid"].astype(str), run["query"]))
    if corpus is None:
        corpus = dict(zip(run["docno"].astype(str), run["text"]))
    return queries, corpus
