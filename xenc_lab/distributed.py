"""Scoring pair tables on a Ray cluster: a pool of ``Scorer`` actors over a Ray Dataset (``map_batches`` with a
callable class), the same engine and the same scores as one process, with Ray's scheduling, streaming and retries.
Needs the ``ray`` extra (``pip install 'xenc-lab[ray]'``)."""
from __future__ import annotations

import os

RETRIES = 3  # an actor that dies is restarted and its batch retried this many times


def _ray():
    try:
        import ray
        import ray.data
    except ImportError:  # pragma: no cover - ray comes with the 'ray' extra
        raise ImportError("xenc_lab.distributed needs Ray Data: pip install 'xenc-lab[ray]'") from None
    return ray


class ScoreBatches:
    """The actor: one Scorer, loaded once; each batch (a pandas DataFrame) comes back with its score column(s)."""

    def __init__(self, model, text_1: str, text_2: str, column: str, threads: int | None, scorer_options: dict,
                 predict_options: dict):
        import torch

        from .scorer import Scorer

        if threads:
            torch.set_num_threads(threads)
        self.scorer = Scorer(model, **scorer_options)
        self.text_1, self.text_2, self.column, self.predict_options = text_1, text_2, column, predict_options

    def __call__(self, batch):
        return self.scorer.score_frame(batch, self.text_1, self.text_2, self.column, show_progress_bar=False,
                                       **self.predict_options)


def read_table(source):
    """A Ray Dataset from a Dataset (returned as is), a parquet, JSON lines or CSV path (a file or a folder), or a
    pandas DataFrame."""
    ray = _ray()
    if isinstance(source, ray.data.Dataset):
        return source
    if type(source).__name__ == "DataFrame":
        return ray.data.from_pandas(source)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"expected a Ray Dataset, a DataFrame or a path, got {type(source).__name__}")
    path = os.fspath(source)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file or folder: {path}")
    kind = _kind(path)
    return {"parquet": ray.data.read_parquet, "jsonl": ray.data.read_json, "csv": ray.data.read_csv}[kind](path)


def _kind(path: str) -> str:
    name = path.rstrip("/").lower().removesuffix(".gz")
    if os.path.isdir(path):
        names = [f.lower() for f in os.listdir(path)]
        for kind, ends in (("parquet", (".parquet",)), ("jsonl", (".jsonl", ".json")), ("csv", (".csv",))):
            if any(f.endswith(ends) for f in names):
                return kind
        raise ValueError(f"{path} holds no .parquet, .jsonl or .csv files")
    for kind, ends in (("parquet", (".parquet",)), ("jsonl", (".jsonl", ".json")), ("csv", (".csv",))):
        if name.endswith(ends):
            return kind
    raise ValueError(f"{path}: expected a .parquet, .jsonl or .csv file (or a folder of them)")


def score_dataset(ds, model, text_1: str = "text_1", text_2: str = "text_2", column: str = "score", *,
                  concurrency: int = 1, num_cpus: float | None = None, num_gpus: float = 0, batch_size: int = 4096,
                  predict_options: dict | None = None, **scorer_options):
    """``ds`` (a Ray Dataset, a parquet/JSON lines/CSV path or a DataFrame) with a score column added by a pool of
    ``concurrency`` Scorer actors, each asking Ray for ``num_cpus`` CPUs (default: the cluster's CPUs but one, which
    Ray Data's read and write tasks need, over the actors) and ``num_gpus`` GPUs, with as many torch threads as it
    has CPUs, rounded; ``scorer_options`` (``dtype``, ``compile``, ``max_length``...) go to each
    ``Scorer``, ``predict_options`` (``prompt``, ``max_length``, ``batch_size``...) to its ``predict``. Rows keep
    their order and every other column; ``batch_size`` rows go to an actor at a time. Lazy, as Ray Datasets are:
    write or collect it."""
    ray = _ray()
    for name, value in (("concurrency", concurrency), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    ds = read_table(ds)
    missing = [c for c in (text_1, text_2) if c not in ds.columns()]
    if missing:
        raise ValueError(f"the dataset has no column(s) {missing}; its columns are {ds.columns()}")
    cpus = ray.cluster_resources().get("CPU", 1) if ray.is_initialized() else os.cpu_count() or 1
    threads = max(1, round(num_cpus or cpus / concurrency))  # each actor's torch threads
    if num_cpus is None:  # one CPU is left to Ray Data's read and write tasks, or they would wait for the actors
        num_cpus = max(0.25, (cpus - 1) / concurrency)
    device = scorer_options.pop("device", "cuda" if num_gpus else "cpu")
    ds.context.execution_options.preserve_order = True  # rows come back in input order (a Dataset keeps its own settings)
    return ds.map_batches(
        ScoreBatches, fn_constructor_args=(str(model), text_1, text_2, column, threads,
                                           {"device": device, **scorer_options}, dict(predict_options or {})),
        batch_format="pandas", batch_size=batch_size, concurrency=concurrency, num_cpus=num_cpus, num_gpus=num_gpus,
        max_restarts=RETRIES, max_task_retries=RETRIES,
    )


class RayScorer:
    """``predict`` on a Ray actor pool, for tools that take a scorer (``xenc_lab.rerank``): each call's pairs become
    a Dataset scored by ``score_dataset``. One-label models; worth it for calls of many thousands of pairs."""

    def __init__(self, model, *, concurrency: int = 1, num_cpus: float | None = None, **options):
        from .loader import architecture_of, load_config, resolve

        config = load_config(resolve(model))
        self.num_labels = 1 if architecture_of(config).endswith("ForCausalLM") else int(config.num_labels)
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
