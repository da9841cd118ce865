"""Does a change move my ranking? One reranking experiment run under several Scorer settings (bf16 against fp32,
``compile=True``, a shorter ``max_length``, int8, another model), each compared with a baseline: score deltas on the
same pairs, what they do to the rankings (Kendall's tau, top-k overlap), and to the metrics."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import resolve_device
from .compare import compare_rankings, summarize_comparison
from .metrics import DEFAULT_MEASURES
from .systems import DEFAULT_DEPTH, is_reranker, run_systems

STANDARD_VARIANTS = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "compile": {"compile": True},
    "max_length=128": {"max_length": 128},
    "int8": {"quantization": "int8"},  # CPU only: left out of the default variants where they run elsewhere
}


@dataclass
class Variants:
    """The reranked runs of one experiment, by variant name; ``depth`` candidates of each query were rescored (None:
    all), and ``seconds`` each variant's reranking took."""

    runs: dict
    baseline: str
    depth: int
    seconds: dict = field(default_factory=dict)

    def head(self, name: str):
        """A variant's run cut to the rescored candidates (rank <= depth)."""
        run = self.runs[name]
        return run if self.depth is None else run[run["rank"] <= self.depth]

    def _head(self, name):
        return self.head(name).set_index(["qid", "docno"])["score"]

    def scores(self):
        """The rescored pairs' scores, one column per variant, indexed by (qid, docno) in the baseline's order."""
        import pandas as pd

        return pd.DataFrame({name: self._head(name) for name in self.runs}).reindex(self._head(self.baseline).index)

    def neighbor_swaps(self, name: str):
        """Each rescored document and the one after it in the baseline's ranking (qid, docno, below), the baseline's
        score gap between them, whether ``name`` scores them equal (``tied``) and whether it ranks them the other way
        round (``swapped``, ties read as trec_eval reads them: docno descending). Swaps where ``gap`` is below the
        variant's score error are near-ties changing places."""
        head, other = self.head(self.baseline), self._head(name)
        pairs = head.assign(below=head.groupby("qid")["docno"].shift(-1),
                            gap=head.groupby("qid")["score"].diff(-1)).dropna(subset=["below"])
        index = lambda column: list(zip(pairs["qid"], pairs[column]))
        above, below = other.reindex(index("docno")).to_numpy(), other.reindex(index("below")).to_numpy()
        tied = above == below
        swapped = (above < below) | (tied & (pairs["below"] > pairs["docno"]).to_numpy())
        return pairs[["qid", "docno", "below", "gap"]].assign(tied=tied, swapped=swapped).reset_index(drop=True)

    def score_deltas(self):
        """Per variant, |score - baseline score| over the rescored pairs: max, mean, 99th percentile, the share of
        pairs scored exactly alike, and the baseline's spread for scale."""
        import pandas as pd

        base = self._head(self.baseline)
        rows = {}
        for name in self.runs:
            delta = (self._head(name).reindex(base.index) - base).abs()
            rows[name] = {"pairs": int(delta.notna().sum()), "max |delta|": delta.max(), "mean |delta|": delta.mean(),
                          "p99 |delta|": delta.quantile(0.99), "equal": float((delta == 0).mean()),
                          "baseline std": base.std()}
        return pd.DataFrame(rows).T

    def taus(self, k: int = 10):
        """Per query and variant, Kendall's tau against the baseline over the rescored candidates."""
        import pandas as pd

        return pd.DataFrame({name: compare_rankings(self.head(self.baseline), self.head(name), k=k)["kendall_tau"]
                             for name in self.runs})

    def rankings(self, k: int = 10, whole: bool = False):
        """Per variant, ``summarize_comparison`` of its ranking against the baseline's: over the rescored
        candidates, or with ``whole=True`` over the whole runs (whose tails keep the first stage's order in every
        variant, which lifts tau)."""
        import pandas as pd

        cut = (lambda name: self.runs[name]) if whole else self.head
        return pd.DataFrame({name: summarize_comparison(compare_rankings(cut(self.baseline), cut(name), k=k))
                             for name in self.runs}).T

    def metrics(self, qrels, measures=DEFAULT_MEASURES, **experiment_kwargs):
        """``experiment``'s table of the variants' runs against the baseline (pt.Experiment's columns: each measure,
        ``mrt``, ``{m} +``, ``{m} -``, ``{m} p-value``, ``{m} p-value corrected``, ``{m} reject``);
        ``experiment_kwargs`` (``test``, ``correction``...) go there."""
        from .experiments import experiment

        table = experiment(self.runs, None, qrels, measures, baseline=self.baseline, **experiment_kwargs)
        at = next((i for i, c in enumerate(table.columns) if " " in c), len(table.columns))  # after the measures
        table.insert(at, "mrt", [1000.0 * self.seconds[n] / max(1, self.runs[n]["qid"].nunique())
                                 for n in table["name"]])
        return table

    def plot(self, qrels=None, measures=("nDCG@10",), k: int = 10):
        """A figure: |score delta| per variant (log scale), the share of queries whose top k changed, and where
        ``qrels`` are given the metric deltas."""
        import matplotlib.pyplot as plt
        import numpy as np

        others = [n for n in self.runs if n != self.baseline]
        panels = 3 if qrels is not None else 2
        fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.4))
        base = self._head(self.baseline)
        for name in others:
            delta = (self._head(name).reindex(base.index) - base).abs().to_numpy()
            axes[0].hist(np.log10(np.maximum(delta, 1e-9)), bins=40, histtype="step", label=name)
        axes[0].set(xlabel="log10 |score - baseline score| (equal: -9)", ylabel="pairs", title="score deltas")
        axes[0].legend(fontsize=8)
        ranks = self.rankings(k).loc[others]
        axes[1].bar(others, 1 - ranks[f"share_identical@{k}"], color="tab:orange")
        axes[1].set(ylabel="share of queries", title=f"top {k} changed vs {self.baseline}")
        axes[1].tick_params(axis="x", labelrotation=20)
        if qrels is not None:
            table = self.metrics(qrels, measures, correction=None).set_index("name")
            names = [c for c in table.columns if c != "mrt" and " " not in c]
            for i, m in enumerate(names):
                values = table.loc[others, m] - table.loc[self.baseline, m]
                axes[2].bar(np.arange(len(others)) + 0.8 * i / len(names), values, width=0.8 / len(names), label=m)
            axes[2].set_xticks(np.arange(len(others)), others, rotation=20)
            axes[2].axhline(0, color="black", lw=0.5)
            axes[2].set(ylabel="delta", title="metric change")
            axes[2].legend(fontsize=8)
        fig.tight_layout()
        return fig


def rerank_variants(model, queries, corpus, run, variants: dict | None = None, depth: int | None = DEFAULT_DEPTH,
                    baseline: str | None = None, scorer_kwargs: dict | None = None, cache=None,
                    **rerank_kwargs) -> Variants:
    """Reranks ``run`` once per variant: a name -> ``Scorer`` keyword arguments (default: ``STANDARD_VARIANTS``, its
    int8 variant only where the Scorers run on the CPU),
    each on ``model`` (a model path, or a Scorer whose settings the variants start from) unless it names its own
    ``model``; ``depth`` candidates per query, as ``rerank`` and ``experiment`` rerank them (default 100).
    ``baseline``: the variant compared against (default: the first). ``cache``: a score cache file every variant
    reads and fills. Returns ``Variants``; ``Variants.metrics(qrels)`` is ``experiment``'s table."""
    from .. import Scorer

    standard, variants = variants is None, dict(STANDARD_VARIANTS if variants is None else variants)
    if not variants or not all(isinstance(v, dict) for v in variants.values()):
        raise TypeError(f"variants must map names to dicts of Scorer arguments, got {variants!r}")
    baseline = next(iter(variants)) if baseline is None else baseline
    if baseline not in variants:
        raise ValueError(f"baseline {baseline!r} is not one of the variants {list(variants)}")
    base_kwargs = {}
    if is_reranker(model):  # a Scorer: its own settings, which each variant changes
        if not hasattr(model, "config"):
            raise TypeError(f"model must be a model path or a xenc_lab Scorer, got {type(model).__name__}")
        c = model.config
        base_kwargs = {"device": c.device, "dtype": c.dtype, "max_length": c.max_length, "page_size": c.page_size,
                       "max_batch_tokens": c.max_batch_tokens, "compile": c.compile,
                       "trust_remote_code": c.trust_remote_code, "long_documents": c.long_documents,
                       "window_stride": c.window_stride}
    runs, seconds = {}, {}
    for name, kwargs in variants.items():
        kwargs = {**base_kwargs, **(scorer_kwargs or {}), **kwargs}
        if standard and kwargs.get("quantization") and resolve_device(kwargs.get("device")).type != "cpu":
            continue  # int8 runs on the CPU only; asked for by name elsewhere, the Scorer refuses it
        path = kwargs.pop("model", model.path if is_reranker(model) else model)
        scorer = model if is_reranker(model) and not variants[name] and not scorer_kwargs else Scorer(path, **kwargs)
        done = run_systems({name: scorer}, queries=queries, corpus=corpus, first_stage=run, depth=depth, cache=cache,
                           **rerank_kwargs)[name]
        runs[name], seconds[name] = done.run, done.seconds  # compile=True includes its compilation
    return Variants(runs, baseline, depth, seconds)
