"""What ``experiment`` accepts as a system, turned into a run: a run file, a run DataFrame (PyTerrier's results frames
too), or a reranker (a ``Scorer``, anything with ``CrossEncoder.predict``, or a model directory) applied to a
first-stage run to a depth, timed."""
from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from .files import _is_frame, read_run

DEFAULT_DEPTH = 100  # candidates a reranker rescores per query, everywhere (rerank, experiment, the CLI)


@dataclass
class SystemRun:
    """A system's run and, for a reranker, the seconds its reranking took and the queries it reranked."""

    run: object
    seconds: float | None = None
    queries: int = 0

    @property
    def mrt(self) -> float:
        """Mean time per query in milliseconds (nan for a given run)."""
        return float("nan") if self.seconds is None or not self.queries else 1000.0 * self.seconds / self.queries


def is_reranker(system) -> bool:
    return callable(getattr(system, "predict", None))


def load_scorer(model, **scorer_kwargs):
    """A ``Scorer`` for a model directory or hub id; a reranker object (with ``predict``) is returned as it is."""
    if is_reranker(model):
        if scorer_kwargs.get("cache") is not None:
            from .reranking import with_cache

            return with_cache(model, scorer_kwargs["cache"])
        return model
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"expected a Scorer (or anything with a predict() method) or a model path, got "
                        f"{type(model).__name__}")
    from .. import Scorer

    return Scorer(model, **{k: v for k, v in scorer_kwargs.items() if v is not None})


def named_systems(systems, names=None) -> dict:
    """``systems`` as an ordered name -> system mapping: a Mapping, or a list (with ``names``, else each path's file
    name or ``system i``)."""
    if isinstance(systems, Mapping):
        if names is not None:
            raise ValueError("names= is for a list of systems; a mapping names its systems by its keys")
        out = {str(k): v for k, v in systems.items()}
        if len(out) != len(systems):
            raise ValueError(f"system names must be distinct as strings, got {list(systems)}")
    elif isinstance(systems, (list, tuple)):
        if names is None:
            names = [os.path.basename(os.fspath(s)) if isinstance(s, (str, os.PathLike)) else f"system {i}"
                     for i, s in enumerate(systems)]
        names = [str(n) for n in names]
        if len(names) != len(systems):
            raise ValueError(f"names has {len(names)} entries for {len(systems)} systems")
        if len(set(names)) != len(names):
            raise ValueError(f"system names must be distinct, got {names}")
        out = dict(zip(names, systems))
    else:
        raise TypeError(f"systems must be a mapping name -> system or a list of systems, got {type(systems).__name__}")
    if not out:
        raise ValueError("systems is empty: give at least one run or reranker")
    return out


def kind_of(name: str, system) -> str:
    """"run" or "reranker", or a TypeError naming what a system may be."""
    if _is_frame(system) or (isinstance(system, (str, os.PathLike)) and os.path.isfile(system)):
        return "run"
    if is_reranker(system) or (isinstance(system, (str, os.PathLike)) and os.path.isdir(system)):
        return "reranker"
    if isinstance(system, (str, os.PathLike)):
        raise FileNotFoundError(f"system {name!r}: {os.fspath(system)} is neither a run file nor a model directory")
    raise TypeError(f"system {name!r}: expected a run (a TREC file or a DataFrame with qid, docno, score) or a "
                    f"reranker (a Scorer, anything with predict(), or a model directory), got {type(system).__name__}")


def run_systems(systems: dict, *, queries, corpus, first_stage, depth, cache=None, show_progress_bar=True,
                **rerank_kwargs) -> dict[str, SystemRun]:
    """Each system's run: given runs are read, rerankers rerank ``first_stage`` (a run or another system's name)."""
    from .reranking import rerank

    kinds = {name: kind_of(name, s) for name, s in systems.items()}
    runs = {name: SystemRun(read_run(s)) for name, s in systems.items() if kinds[name] == "run"}
    rerankers = [name for name, kind in kinds.items() if kind == "reranker"]
    if not rerankers:
        return runs
    if first_stage is None:
        raise ValueError(f"systems {rerankers} rerank a first stage: pass first_stage= (a run, or the name of one of "
                         f"the run systems {[n for n in runs]})")
    if isinstance(first_stage, str) and first_stage in systems:
        if first_stage not in runs:
            raise ValueError(f"first_stage={first_stage!r} names a reranker; it must name a run")
        first = runs[first_stage].run
    else:
        first = read_run(first_stage)
        if _is_frame(first_stage):  # a PyTerrier results frame brings its texts (query, text)
            for column in ("query", "text"):
                if column in first_stage.columns:
                    first[column] = first_stage[column].to_numpy()
    for name in rerankers:
        scorer = load_scorer(systems[name], cache=cache)
        start = time.perf_counter()
        run = rerank(scorer, queries, corpus, first, depth=depth, show_progress_bar=show_progress_bar,
                     **rerank_kwargs)
        runs[name] = SystemRun(run, time.perf_counter() - start, int(run["qid"].nunique()))
    return {name: runs[name] for name in systems}
