"""``rerank``: a first-stage run's top candidates rescored by a cross-encoder, all queries' pairs streamed through the
engine together, whole queries up to ``pairs_per_call`` pairs per engine call, each query written to the output as it
completes (so an interrupted run resumes)."""
from __future__ import annotations

import numbers
import os
import warnings
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from .files import check_tag, format_run_lines, read_corpus, read_queries, read_run, texts_of_run

PAIRS_PER_CALL = 4096  # pairs scored per engine call: bounds the texts and scores in flight, not the run's size


@dataclass
class Candidates:
    """One query's candidates in first-stage order: the first ``depth`` are reranked, the rest keep their order."""

    qid: str
    docnos: list[str]
    depth: int
    scores: list[float] = field(default_factory=list)  # the reranked head's scores, once scored


def first_stage_order(run) -> dict[str, list[str]]:
    """qid -> docnos in the order trec_eval reads a run: score descending, ties by docno descending. Queries keep
    their first appearance's order."""
    ordered = run.sort_values(["score", "docno"], ascending=False, kind="stable")
    groups = {qid: [] for qid in run["qid"].unique()}
    for qid, docno in zip(ordered["qid"], ordered["docno"]):
        groups[qid].append(docno)
    return groups


def reranked_order(docnos: list[str], scores: list[float], rest: list[str]) -> tuple[list[str], list[float]]:
    """The head by score (ties by docno descending, as trec_eval breaks them, so the file's rank column is the order
    evaluation reads), then the rest in first-stage order with scores strictly below the head's."""
    head = sorted(zip(scores, docnos), reverse=True)
    floor = head[-1][0] if head else 0.0
    return [d for _, d in head] + rest, [s for s, _ in head] + [floor - 1.0 - i for i in range(len(rest))]


def _few(ids, n: int = 5) -> str:
    ids = list(ids)
    return ", ".join(map(repr, ids[:n])) + (f" and {len(ids) - n} more" if len(ids) > n else "")


def _check_inputs(run, texts, docs, depth, skip_missing) -> tuple[dict[str, list[str]], dict[str, int]]:
    """The run's queries and candidates with text, or a ValueError naming a few that have none. With
    ``skip_missing`` those are dropped instead, and counted."""
    order = first_stage_order(run)
    no_text = [q for q in order if not (texts.get(q) or "").strip()]
    absent = sorted({d for docnos in order.values() for d in docnos[:depth] if docs.get(d) is None})
    if (no_text or absent) and not skip_missing:
        problems = []
        if no_text:
            problems.append(f"{len(no_text)} of its {len(order)} queries have no text in the queries ({_few(no_text)})")
        if absent:
            problems.append(f"{len(absent)} candidate documents are not in the corpus ({_few(absent)})")
        raise ValueError("the run cannot be reranked: " + "; ".join(problems)
                         + ". Pass skip_missing=True (--skip-missing) to leave them out")
    absent_set = set(absent)
    skipped = {"queries": len(no_text), "documents": 0}
    kept = {}
    for qid, docnos in order.items():
        if qid in no_text:
            continue
        present = [d for d in docnos if d not in absent_set]
        skipped["documents"] += len(docnos) - len(present)
        kept[qid] = present
    if skipped["queries"] or skipped["documents"]:
        warnings.warn(f"skipped {skipped['queries']} queries without text and {skipped['documents']} candidates "
                      "missing from the corpus", stacklevel=3)
    return kept, skipped


def _resume(path, plan: dict[str, list[str]]) -> tuple[dict[str, tuple[list[str], list[float]]], int]:
    """The complete queries of an earlier output (each a block of its planned candidates) and the bytes they fill;
    a trailing incomplete block (an interrupted write) is dropped. Output of another run is refused."""
    where = os.fspath(path)
    done: dict[str, tuple[list[str], list[float]]] = {}
    good = pos = 0
    qid, docnos, scores = None, [], []
    with open(path, "rb") as f:
        for no, raw in enumerate(f, 1):
            parts = raw.decode("utf-8").split()
            if len(parts) != 6 or not raw.endswith(b"\n"):
                break  # an interrupted line ends what can be kept
            if parts[0] != qid:
                if docnos:
                    raise ValueError(f"{where}, line {no}: query {qid!r} ends after {len(docnos)} of its "
                                     f"{len(plan[qid])} candidates; pass overwrite=True to start again")
                qid = parts[0]
                if qid not in plan or qid in done:
                    why = "appears twice" if qid in done else "is not in the run being reranked"
                    raise ValueError(f"{where}, line {no}: query {qid!r} {why}; the file was written from another "
                                     "run (pass overwrite=True to start again)")
            docnos.append(parts[2])
            scores.append(float(parts[4]))
            pos += len(raw)
            if len(docnos) == len(plan[qid]):
                if sorted(docnos) != sorted(plan[qid]):
                    raise ValueError(f"{where}: query {qid!r} holds other candidates than the run's; the file was "
                                     "written from another run (pass overwrite=True to start again)")
                done[qid], good, docnos, scores = (docnos, scores), pos, [], []
    return done, good


def rerank(
    scorer,
    queries,
    corpus,
    run,
    depth: int | None = 100,
    *,
    output: str | os.PathLike | None = None,
    resume: bool = False,
    overwrite: bool = False,
    tag: str = "xenc_lab",
    title_sep: str | None = " ",
    skip_missing: bool = False,
    pairs_per_call: int = PAIRS_PER_CALL,
    window: int | None = None,
    show_progress_bar: bool = True,
    cache=None,
    **predict_kwargs,
):
    """Reranks each query's top ``depth`` candidates of ``run`` with ``scorer`` and returns the new run as a DataFrame
    (qid, docno, score, rank).

    ``queries``, ``corpus`` and ``run``: file paths (BEIR JSONL, MS MARCO TSV, TREC run; gzip too), DataFrames or
    dicts. A document's text is its title, ``title_sep`` and its text where it has a title (None: text only).
    Candidates below ``depth`` (None: all are reranked) keep their first-stage order, scored below the reranked
    ones. ``output``: a TREC run file written query by query; ``resume=True`` continues one that was interrupted.
    ``pairs_per_call``: the pairs of whole queries given to each engine call (a query with more still goes whole);
    ``window`` is its old name, deprecated ("window" is a long document's, ``long_documents``/``window_stride``).
    ``scorer``: a ``Scorer``, a model directory or hub id (loaded as a Scorer), or anything with
    ``CrossEncoder.predict``'s signature (a ``CrossEncoder`` itself, to compare); ``predict_kwargs`` (``batch_size``,
    ``prompt``, ``max_length``, ``long_documents``...) go to its ``predict``. ``cache``: a score cache file (or
    ``ScoreCache``) the Scorer reads and fills (``score_cache.py``); the Scorer passed is left without it."""
    is_path = isinstance(scorer, (str, os.PathLike))
    if not is_path and not callable(getattr(scorer, "predict", None)):
        raise TypeError(f"scorer must be a Scorer, a model path or have a predict() method (a CrossEncoder), got "
                        f"{type(scorer).__name__}")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, numbers.Integral) or depth < 1):
        raise ValueError(f"depth must be a positive int or None (rerank all), got {depth!r}")
    if window is not None:
        if pairs_per_call != PAIRS_PER_CALL:
            raise TypeError("pass pairs_per_call= alone: window= is its old name")
        warnings.warn("rerank(window=) is deprecated: pass pairs_per_call= (pairs per engine call)", DeprecationWarning,
                      stacklevel=2)
        pairs_per_call = window
    if isinstance(pairs_per_call, bool) or not isinstance(pairs_per_call, numbers.Integral) or pairs_per_call < 1:
        raise ValueError(f"pairs_per_call must be a positive int, got {pairs_per_call!r}")
    for name in ("convert_to_numpy", "convert_to_tensor", "apply_softmax"):
        if name in predict_kwargs:
            raise TypeError(f"rerank() sets {name} itself; leave it out")
    check_tag(tag)
    if resume and overwrite:
        raise ValueError("pass resume=True or overwrite=True, not both")
    if output is not None and os.path.exists(output) and not (resume or overwrite):
        raise FileExistsError(f"{os.fspath(output)} exists: pass resume=True (--resume) to continue it or "
                              "overwrite=True (--overwrite) to start again")
    if resume and output is None:
        raise ValueError("resume=True needs an output file to continue")
    if is_path:
        from .. import Scorer

        scorer = Scorer(scorer, cache=cache)
    elif cache is not None:
        scorer = with_cache(scorer, cache)
    if getattr(scorer, "num_labels", 1) != 1:
        raise ValueError(f"rerank needs a one-label model (one score per pair); this one has {scorer.num_labels} "
                         "labels")

    if queries is None or corpus is None:
        queries, corpus = texts_of_run(run, queries, corpus)
    run = read_run(run)
    head_of = lambda docnos: docnos if depth is None else docnos[:depth]
    wanted = {d for docnos in first_stage_order(run).values() for d in head_of(docnos)}
    texts = read_queries(queries)
    docs = read_corpus(corpus, ids=wanted, title_sep=title_sep)
    plan, skipped = _check_inputs(run, texts, docs, depth, skip_missing)

    done, good = ({}, 0) if not (resume and output is not None and os.path.exists(output)) else _resume(output, plan)
    rows: dict[str, tuple[list[str], list[float]]] = dict(done)
    todo = [Candidates(q, docnos, len(head_of(docnos))) for q, docnos in plan.items() if q not in done]
    sink = None
    if output is not None:
        sink = open(output, "r+b" if resume and os.path.exists(output) else "wb")
        sink.seek(good)
        sink.truncate()
    try:
        total = sum(c.depth for c in todo)
        with tqdm(total=total, desc="Reranking", unit="pair", disable=not show_progress_bar) as bar:
            start = 0
            while start < len(todo):
                group, n = [], 0
                while start < len(todo) and (not group or n + todo[start].depth <= pairs_per_call):
                    group.append(todo[start])
                    n += todo[start].depth
                    start += 1
                pairs = [(texts[c.qid], docs[d]) for c in group for d in c.docnos[: c.depth]]
                scores = scorer.predict(pairs, show_progress_bar=False, **predict_kwargs) if pairs else []
                offset = 0
                for c in group:
                    head = [float(s) for s in scores[offset: offset + c.depth]]
                    offset += c.depth
                    docnos, values = reranked_order(c.docnos[: c.depth], head, c.docnos[c.depth:])
                    rows[c.qid] = (docnos, values)
                    if sink is not None:
                        sink.write(format_run_lines(c.qid, docnos, values, tag).encode())
                        sink.flush()
                        good = sink.tell()
                bar.update(n)
    finally:
        if sink is not None:
            sink.truncate(good)  # an interrupted write leaves complete queries only
            sink.close()
    return _frame(plan, rows, skipped)


def _frame(plan, rows, skipped):
    import pandas as pd

    qids, docnos, scores, ranks = [], [], [], []
    for qid in plan:  # the run's query order
        d, s = rows[qid]
        qids += [qid] * len(d)
        docnos += d
        scores += s
        ranks += range(1, len(d) + 1)
    frame = pd.DataFrame({"qid": qids, "docno": docnos, "score": pd.array(scores, dtype="float64"),
                          "rank": pd.array(ranks, dtype="int64")})
    frame.attrs["skipped"] = skipped
    return frame


def with_cache(scorer, cache):
    """``scorer`` scoring through ``cache`` (a path or a ScoreCache): a shallow copy sharing its model and lock, so
    the caller's Scorer is left as it was. A reranker that is not a Scorer cannot be fingerprinted: TypeError."""
    import copy

    from ..score_cache import open_cache
    from ..scorer import Scorer

    if cache is None:
        return scorer
    if not isinstance(scorer, Scorer):
        raise TypeError(f"a score cache needs a xenc_lab Scorer (its weights are fingerprinted), got "
                        f"{type(scorer).__name__}")
    copied = copy.copy(scorer)
    copied.cache = open_cache(cache)
    return copied
