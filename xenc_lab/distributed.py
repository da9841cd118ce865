"""Scoring pair tables on a Ray cluster: a pool of ``Scorer`` actors over a Ray Dataset (``map_batches`` with a
callable class), the same engine and the same scores as one process, with Ray's scheduling, streaming and retries.
Needs the ``ray`` extra (``pip install 'xenc-lab[ray]'``)."""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

KINDS = {"parquet": (".parquet",), "jsonl": (".jsonl", ".json"), "csv": (".csv",)}
READERS = {"parquet": "read_parquet", "jsonl": "read_json", "csv": "read_csv"}


def _ray():
    try:
        import ray
        import ray.data
    except ImportError:  # pragma: no cover - ray comes with the 'ray' extra
        raise ImportError("xenc_lab.distributed needs Ray Data: pip install 'xenc-lab[ray]'") from None
    return ray


class ScoreBatches:
    """The actor: one Scorer, loaded once, running ``threads`` torch threads; each batch (a pandas DataFrame) comes
    back with its score column(s)."""

    def __init__(self, model, text_1: str, text_2: str, column: str, threads: int, scorer_options: dict,
                 predict_options: dict):
        import torch

        from .scorer import Scorer

        torch.set_num_threads(threads)
        self.scorer = Scorer(model, **scorer_options)
        self.text_1, self.text_2, self.column, self.predict_options = text_1, text_2, column, predict_options

    def __call__(self, batch):
        return self.scorer.score_frame(batch, self.text_1, self.text_2, self.column, show_progress_bar=False,
                                       **self.predict_options)


@dataclass(frozen=True)
class ActorPlan:
    """What each of ``concurrency`` actors asks Ray for (``num_cpus``, ``num_gpus``) and the torch threads it runs."""
    concurrency: int
    num_cpus: float
    num_gpus: float
    threads: int


def plan_actors(concurrency: int = 1, num_cpus: float | None = None, num_gpus: float = 0,
                threads: int | None = None) -> ActorPlan:
    """The resources and threads ``score_dataset`` gives its actors. By default the actors spread evenly over the
    nodes with CPUs, and on each node they share its CPUs but one, which Ray Data's read and write tasks need (on two
    cores, with every CPU given to actors, reading waits forever); each runs as many torch threads as its share of
    the node's CPUs, that one included, rounded (the read tasks are short). A given ``num_cpus`` is taken as is,
    with as many threads, rounded, unless ``threads`` says otherwise."""
    ray = _ray()
    for name, value in (("concurrency", concurrency), ("threads", threads)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    if ray.is_initialized():
        node_cpus = [n["Resources"]["CPU"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")]
    else:
        node_cpus = [os.cpu_count() or 1]
    cpus = min(node_cpus or [1])  # the smallest node, so every actor fits wherever it is placed
    per_node = math.ceil(concurrency / max(1, len(node_cpus)))
    if num_cpus is None:
        num_cpus = max(0.25, (cpus - 1) / per_node)
        shared = cpus / per_node
    else:
        shared = num_cpus
    return ActorPlan(concurrency, float(num_cpus), float(num_gpus), threads or max(1, round(shared)))


def read_table(source, format: str | None = None):
    """A Ray Dataset from a Dataset (returned as is), a pandas DataFrame, or a parquet, JSON lines or CSV path: a
    file or a folder, on this machine or at a URI Ray reads (``s3://``, ``gs://``...). ``format`` ("parquet",
    "jsonl" or "csv") is needed only when neither the name nor the folder's files say it."""
    ray = _ray()
    if isinstance(source, ray.data.Dataset):
        return source
    if type(source).__name__ == "DataFrame":
        return ray.data.from_pandas(source)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"expected a Ray Dataset, a DataFrame or a path, got {type(source).__name__}")
    path = os.fspath(source)
    if format is not None and format not in READERS:
        raise ValueError(f"format must be one of {sorted(READERS)}, got {format!r}")
    local = None if "://" in path and not path.startswith("file://") else path.removeprefix("file://")
    if local is not None and not os.path.exists(local):
        raise FileNotFoundError(f"no such file or folder: {path}")
    if format is not None:  # the name says nothing: read every file, whatever its suffix
        return getattr(ray.data, READERS[format])(path, file_extensions=None)
    return getattr(ray.data, READERS[table_kind(path, local)])(path)


def table_kind(name: str, local: str | None = None) -> str:
    """"parquet", "jsonl" or "csv", from a name's suffix (``.gz`` aside) or, for a local folder, its files."""
    if local is not None and os.path.isdir(local):
        files = [f.lower().removesuffix(".gz") for f in os.listdir(local)]
        for kind, ends in KINDS.items():
            if any(f.endswith(ends) for f in files):
                return kind
        raise ValueError(f"{name} holds no .parquet, .jsonl or .csv files")
    base = name.rstrip("/").lower().removesuffix(".gz")
    for kind, ends in KINDS.items():
        if base.endswith(ends):
            return kind
    raise ValueError(f"{name}: expected a .parquet, .jsonl or .csv file (or a folder of them; for a remote folder "
                     f"say which with format=)")


def score_dataset(ds, model, text_1: str = "text_1", text_2: str = "text_2", column: str = "score", *,
                  concurrency: int = 1, num_cpus: float | None = None, num_gpus: float = 0,
                  threads: int | None = None, batch_size: int = 4096, format: str | None = None,
                  predict_options: dict | None = None, **scorer_options):
    """``ds`` (a Ray Dataset, a DataFrame, or a parquet/JSON lines/CSV path or URI) with a score column added by a
    pool of ``concurrency`` Scorer actors. Each asks Ray for ``num_cpus`` CPUs and ``num_gpus`` GPUs and runs
    ``threads`` torch threads (defaults: ``plan_actors``). ``scorer_options`` (``dtype``, ``compile``,
    ``max_length``...) go to each ``Scorer``, ``predict_options`` (``prompt``, ``max_length``...) to its
    ``predict``. Rows keep their order and every other column. The table is cut into blocks of ``batch_size``
    rows, one actor call each, so that every actor has work even when the input is one file. Lazy, as Ray Datasets
    are: write or collect it."""
    ray = _ray()
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    plan = plan_actors(concurrency, num_cpus, num_gpus, threads)
    ds = read_table(ds, format)
    missing = [c for c in (text_1, text_2) if c not in ds.columns()]
    if missing:
        raise ValueError(f"the dataset has no column(s) {missing}; its columns are {ds.columns()}")
    device = scorer_options.pop("device", "cuda" if num_gpus else "cpu")
    ds.context.execution_options.preserve_order = True  # rows come back in input order (a Dataset keeps its own settings)
    # Blocks of exactly batch_size rows (the last aside), each one actor call; streamed. One file is one block otherwise.
    ds = ds.repartition(target_num_rows_per_block=batch_size, strict=True)
    # Ray Data restarts a dead actor and retries its batch by default (max_restarts=-1, max_task_retries=-1).
    return ds.map_batches(
        ScoreBatches, fn_constructor_args=(str(model), text_1, text_2, column, plan.threads,
                                           {"device": device, **scorer_options}, dict(predict_options or {})),
        batch_format="pandas", batch_size=batch_size, compute=ray.data.ActorPoolStrategy(size=plan.concurrency),
        num_cpus=plan.num_cpus, num_gpus=plan.num_gpus, udf_modifying_row_count=False,
    )


def actor_rate(ds) -> float:
    """Pairs/s of one actor while scoring, from a scored Dataset that has run (iterated, written or collected): the
    rows of its ``ScoreBatches`` stage over the summed wall time of their calls (Ray Data's "estimated single task
    throughput"); NaN where Ray's stats do not say."""
    stage = re.search(r"MapBatches\(ScoreBatches\).*?(?=\nOperator |\nDataset throughput|\Z)", ds.stats(), re.S)
    rate = stage and re.search(r"Estimated single task throughput: ([\d.e+]+) rows/s", stage.group(0))
    return float(rate.group(1)) if rate else float("nan")


class RayScorer:
    """``predict`` on a Ray actor pool, for tools that take a scorer (``xenc_lab.rerank``): each call's pairs become
    a Dataset scored by ``score_dataset``. One-label models; worth it for calls of many thousands of pairs."""

    def __init__(self, model, *, concurrency: int = 1, num_cpus: float | None = None, **options):
        from .loader import family_of, load_config, resolve

        config = load_config(resolve(model))
        self.num_labels = family_of(config).num_labels_of(config)
        if self.num_labels != 1:
            raise ValueError(f"RayScorer scores one-label models; this one has {self.num_labels} labels")
        self.model, self.concurrency, self.num_cpus, self.options = model, concurrency, num_cpus, options

    def predict(self, pairs, show_progress_bar=None, **predict_options):
        import numpy as np
        import pandas as pd

        from .st_args import split_pairs

        text_1, text_2 = split_pairs(list(pairs))
        if not text_1:
            return np.zeros(0, dtype=np.float32)
        frame = pd.DataFrame({"text_1": text_1, "text_2": text_2})
        ds = score_dataset(frame, self.model, concurrency=self.concurrency, num_cpus=self.num_cpus,
                           predict_options=predict_options, **self.options)
        return ds.to_pandas()["score"].to_numpy(dtype=np.float32)
