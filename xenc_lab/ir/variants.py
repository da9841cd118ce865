"""Does a change move my ranking? One reranking experiment run under several Scorer settings (bf16 against fp32,
``compile=True``, a shorter ``max_length``, another model), each compared with a baseline: score deltas on the same
pairs, what they do to the rankings (Kendall's tau, top-k overlap), and to the metrics."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .compare import compare_rankings, summarize_comparison
from .metrics import significance
from .reranking import rerank

STANDARD_VARIANTS = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "compile": {"compile": True},
    "max_length=128": {"max_length": 128},
}


@dataclass
class Variants:
    """The reranked runs of one experiment, by variant name; ``depth`` candidates of each query were rescored."""

    runs: dict
    baseline: str
    depth: int
    seconds: dict = field(default_factory=dict)

    def head(self, name: str):
        """A variant's run cut to the rescored candidates (rank <= depth)."""
        run = self.runs[name]
        return run[run["rank"] <= self.depth]

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

    def metrics(self, qrels, measures=("nDCG@10", "RR@10"), trials: int = 10000):
        """Per variant and measure: the value, its change from the baseline and the paired tests' p-values."""
        import pandas as pd

        frames = []
        for name, run in self.runs.items():
            tests = significance(self.runs[self.baseline], run, qrels, measures, trials=trials)
            frames.append(pd.DataFrame({"variant": name, "measure": tests.index, "value": tests["mean_b"].to_numpy(),
                                        "delta": tests["delta"].to_numpy(), "t_p": tests["t_p"].to_numpy(),
                                        "perm_p": tests["perm_p"].to_numpy()}))
        return pd.concat(frames, ignore_index=True).set_index(["variant", "measure"])

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
        axes[1].bar(others, 1 - ranks[f"share_same_top_{k}"], color="tab:orange")
        axes[1].set(ylabel="share of queries", title=f"top {k} changed vs {self.baseline}")
        axes[1].tick_params(axis="x", labelrotation=20)
        if qrels is not None:
            table = self.metrics(qrels, measures).loc[others]
            for i, m in enumerate(table.index.get_level_values("measure").unique()):
                values = table.xs(m, level="measure")["delta"]
                axes[2].bar(np.arange(len(others)) + 0.8 * i / len(measures), values, width=0.8 / len(measures), label=m)
            axes[2].set_xticks(np.arange(len(others)), others, rotation=20)
            axes[2].axhline(0, color="black", lw=0.5)
            axes[2].set(ylabel="delta", title="metric change")
            axes[2].legend(fontsize=8)
        fig.tight_layout()
        return fig


def rerank_variants(model, queries, corpus, run, variants: dict | None = None, depth: int = 20,
                    baseline: str | None = None, scorer_kwargs: dict | None = None, **rerank_kwargs) -> Variants:
    """Reranks ``run`` once per variant: a name -> ``Scorer`` keyword arguments (default: ``STANDARD_VARIANTS``),
    each on ``model`` unless it names its own ``model``. ``baseline``: the variant compared against (default: the
    first). Returns ``Variants``."""
    from .. import Scorer

    variants = dict(STANDARD_VARIANTS if variants is None else variants)
    if not variants or not all(isinstance(v, dict) for v in variants.values()):
        raise TypeError(f"variants must map names to dicts of Scorer arguments, got {variants!r}")
    baseline = next(iter(variants)) if baseline is None else baseline
    if baseline not in variants:
        raise ValueError(f"baseline {baseline!r} is not one of the variants {list(variants)}")
    runs, seconds = {}, {}
    for name, kwargs in variants.items():
        kwargs = {**(scorer_kwargs or {}), **kwargs}
        scorer = Scorer(kwargs.pop("model", model), **kwargs)
        start = time.perf_counter()
        runs[name] = rerank(scorer, queries, corpus, run, depth=depth, **rerank_kwargs)
        seconds[name] = time.perf_counter() - start  # compile=True includes its compilation
    return Variants(runs, baseline, depth, seconds)
