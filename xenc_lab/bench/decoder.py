"""Decoder rerankers beside sentence-transformers: one query and N documents (a 1:N rerank) through Qwen3-Reranker's
chat template, scored by logit("yes") - logit("no") at the last token.

Three engines on the same pairs, in one process, alternating runs, tokenization included: xenc_lab with prefix sharing
on (the system prompt, instruction and query computed once into the paged KV cache), xenc_lab with it off, and
sentence-transformers' ``CrossEncoder``; with ``int8``, a fourth: xenc_lab with ``quantization="int8"``, sharing on.
The models are random-weight ``Qwen3ForCausalLM`` checkpoints built here, offline and deterministically, and cached
(``decoder_reranker``): the numbers are about speed and agreement, not relevance. Their tokenizer is a byte-level BPE
behind Qwen2's split regex, trained on the workload's own vocabulary, so that its words are mostly single tokens as
in a real vocabulary.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import whole_number
from ..provenance import provenance
from ..zoo.decoders import DEFAULT_INSTRUCTION, JUDGE, WORKLOAD_ARCHITECTURE, workload_reranker
from .timing import _check_run, cpu_has_fast_bf16
from .workloads import make_pairs

INSTRUCTION = DEFAULT_INSTRUCTION  # Qwen3-Reranker's default instruction, in the template and the tokenizer's texts
_TAIL = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"

_QWEN3 = {"tie_word_embeddings": True, "max_position_embeddings": 40960, "rope_theta": 1_000_000.0,
          "rms_norm_eps": 1e-6}
# name -> (documents timed by default, config). qwen3-0.6b has Qwen3-Reranker-0.6B's shape but for its vocabulary.
MODELS = {
    "qwen3-0.6b": (16, dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                            head_dim=128, intermediate_size=3072, **_QWEN3)),
    "qwen3-small": (100, dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                              head_dim=64, intermediate_size=1152, **_QWEN3)),
    "qwen3-tiny": (8, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, intermediate_size=128, **_QWEN3)),
}
DEFAULT_MODELS = ("qwen3-0.6b", "qwen3-small")
VOCAB_SIZE = 8192  # the BPE's cap: training stops earlier, once every word of the workload is one token
ENGINES = ("sentence-transformers", "xenc_lab sharing on", "xenc_lab sharing off")
INT8_ENGINE = "xenc_lab int8 sharing on"  # the fourth engine, where asked for
# The issues' goals: sharing's share of its ideal gain, fp32 pairs/s over sentence-transformers', fp32 max |delta|,
# bf16 error over sentence-transformers' own bf16 error; int8 at qwen3-0.6b, seconds per 100 documents.
GOALS = {"gain_share": 0.85, "fp32_ratio": 2.0, "fp32_delta": 1e-4, "bf16_error_ratio": 1.5,
         "int8_seconds_per_100": 10.0}
# Deltas and errors are measured on at least this many pairs: the timed ones and more queries' (a 16-bit model's
# error on a score moves by about its own size between pairs, so 16 pairs' mean tells two engines apart poorly).
ACCURACY_PAIRS = 64


def accuracy_pairs(n_docs: int, seed: int = 0) -> list[tuple[str, str]]:
    """The timed pairs (``rerank_pairs(n_docs, seed)``), then as many more queries' (seeds seed + 1, ...) as bring
    them to ACCURACY_PAIRS or more."""
    pairs = rerank_pairs(n_docs, seed)
    while len(pairs) < ACCURACY_PAIRS:
        pairs += rerank_pairs(n_docs, seed + len(pairs) // n_docs)
    return pairs


def rerank_pairs(n_docs: int, seed: int = 0) -> list[tuple[str, str]]:
    """One query (5-15 words) and ``n_docs`` MS MARCO-like passages (50-100 words): ``make_pairs("short")``'s texts."""
    pairs = make_pairs("short", whole_number("n_docs", n_docs), seed=seed)
    return [(pairs[0][0], doc) for _, doc in pairs]


def workload_texts() -> list[str]:
    """What the benchmark models' BPE is trained on: the template's text around 2,000 workload pairs (seed 12345), and
    "yes"/"no" at the start of a line."""
    head = f"{JUDGE}<|im_start|>user\n<Instruct>: {INSTRUCTION}\n<Query>: "
    return [f"{head}{q}\n<Document>: {d}{_TAIL}" for q, d in make_pairs("short", 2000, seed=12345)] + ["yes\nno"] * 50


def decoder_reranker(name: str = "qwen3-small", root: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """Build (once) and return the directory of the random-weight Qwen3 reranker ``name`` (one of ``MODELS``) under
    ``root`` (default: xenc_lab's cache), a checkpoint that ``CrossEncoder`` and ``Scorer`` load offline
    (``xenc_lab.zoo.decoders.workload_reranker``)."""
    from ..zoo import cache_dir

    if name not in MODELS:
        raise ValueError(f"name must be one of {sorted(MODELS)}, got {name!r}")
    root = Path(root) if root is not None else cache_dir()
    return workload_reranker(f"bench-{name}", root, MODELS[name][1], workload_texts(), seed=seed, vocab_size=VOCAB_SIZE)


@dataclass
class DecoderRow:
    model: str
    dtype: str
    engine: str  # one of ENGINES
    pairs: int
    tokens_total: int  # tokens of the pairs (the template's included)
    tokens_computed: int  # tokens the model ran: xenc_lab's token_counts.computed (0: not counted, sentence-transformers)
    pairs_per_s: float
    ratio: float  # pairs/s over sentence-transformers' at the same dtype: the median of the rounds' ratios
    max_abs_delta: float  # raw scores against sentence-transformers fp32 on the same pairs
    mean_abs_delta: float
    seconds: float  # the median of the timed runs
    ideal_gain: float = 0.0  # sharing on: tokens_total / tokens_computed
    measured_gain: float = 0.0  # sharing on: pairs/s over xenc_lab's with sharing off (the median of the rounds')
    gain_share: float = 0.0  # measured_gain / ideal_gain
    error_ratio: float = 0.0  # xenc_lab at a dtype other than float32: mean |delta| over sentence-transformers' own
    max_error_ratio: float = 0.0  # ... and by the max
    oracle_drift: float = 0.0  # max |change| of sentence-transformers' fp32 scores between its timed runs
    accuracy_pairs: int = 0  # the pairs the deltas are measured on (accuracy_pairs)
    over_sharing: float = 0.0  # int8: pairs/s over xenc_lab's sharing on at the same dtype (the median of the rounds')


def _time_engines(path, pairs, dtype: str, repeats: int, st_batch_size: int, budget: dict, compile: bool = False,
                  check=None, int8: bool = False):
    """Each engine's timed runs (seconds), last scores and (xenc_lab) last token counts, and its scores on the
    ``check`` pairs (default: ``pairs``): every engine first runs the pairs once untimed, so that each batch shape
    the timed runs meet has been met; then ``repeats`` rounds, each starting with the next engine; then ``check``
    once. ``int8`` adds INT8_ENGINE, a second model loaded with ``quantization="int8"``. The models are freed on
    return."""
    from sentence_transformers import CrossEncoder

    from ..scorer import Scorer

    identity = torch.nn.Identity()
    theirs = CrossEncoder(str(path), device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})
    ours = Scorer(path, device="cpu", dtype=dtype, compile=compile, **budget)
    if not ours.decoder:
        raise ValueError(f"{path}: {ours.architecture} is not a decoder reranker")
    quantized = (Scorer(path, device="cpu", dtype=dtype, compile=compile, quantization="int8", **budget) if int8
                 else None)
    engines = ENGINES + ((INT8_ENGINE,) if int8 else ())

    def run_engine(engine: str, pairs=pairs):
        if engine == ENGINES[0]:
            return theirs.predict(pairs, activation_fn=identity, batch_size=st_batch_size), None
        if engine == INT8_ENGINE:
            return quantized.predict(pairs, activation_fn=identity), quantized.token_counts
        ours.share_prefix = engine == ENGINES[1]  # one model in memory for both: the flag is read per call
        return ours.predict(pairs, activation_fn=identity), ours.token_counts

    for engine in engines:
        run_engine(engine)
    times, outs = {e: [] for e in engines}, {e: [] for e in engines}
    for r in range(repeats):
        for engine in engines[r % len(engines):] + engines[: r % len(engines)]:
            start = time.perf_counter()
            outs[engine].append(run_engine(engine))
            times[engine].append(time.perf_counter() - start)
    checked = {e: np.asarray(outs[e][-1][0] if check is None else run_engine(e, check)[0]) for e in engines}
    return times, outs, checked


def paired_ratio(slow: list[float], fast: list[float]) -> float:
    """How many times faster ``fast`` ran than ``slow``: the median over rounds of their seconds' ratio. The engines
    of a round run back to back, so a slow spell of the machine (minutes long on these shared machines) falls on
    both terms of a round's ratio, where it would move one engine's median alone."""
    return statistics.median(s / f for s, f in zip(slow, fast, strict=True))


def _rows(name: str, dtype: str, n: int, times: dict, outs: dict, checked: dict, exact) -> list[DecoderRow]:
    """The engines' rows (those in ``times``) from their timed runs, deltas of their ``checked`` scores against
    ``exact`` (None: sentence-transformers' own here are the fp32 reference, and the drift of its timed runs is
    reported)."""
    drift = 0.0
    if exact is None:
        exact = checked[ENGINES[0]]
        drift = float(np.abs(np.asarray(outs[ENGINES[0]][0][0]) - np.asarray(outs[ENGINES[0]][-1][0])).max())
    engines = list(times)
    counts = {e: outs[e][-1][1] for e in engines[1:]}
    total = counts[ENGINES[1]].total
    computed = {ENGINES[0]: 0, **{e: c.computed for e, c in counts.items()}}
    seconds = {e: statistics.median(times[e]) for e in engines}
    rates = {e: n / seconds[e] for e in engines}
    speedup = lambda slow, fast: paired_ratio(times[slow], times[fast])
    rows = []
    for e in engines:
        delta = np.abs(checked[e] - exact)
        rows.append(DecoderRow(
            model=name, dtype=dtype, engine=e, pairs=n, tokens_total=total, tokens_computed=computed[e],
            pairs_per_s=rates[e], ratio=speedup(ENGINES[0], e), max_abs_delta=float(delta.max()),
            mean_abs_delta=float(delta.mean()), seconds=seconds[e], oracle_drift=drift, accuracy_pairs=len(exact)))
    st, shared = rows[0], rows[1]
    shared.ideal_gain = total / shared.tokens_computed
    shared.measured_gain = speedup(ENGINES[2], ENGINES[1])
    shared.gain_share = shared.measured_gain / shared.ideal_gain
    for row in rows[3:]:
        row.over_sharing = speedup(ENGINES[1], row.engine)
    if dtype != "float32" and st.mean_abs_delta:
        for row in rows[1:]:
            row.error_ratio = row.mean_abs_delta / st.mean_abs_delta
            row.max_error_ratio = row.max_abs_delta / st.max_abs_delta
    return rows


def run(
    models=DEFAULT_MODELS,
    dtypes=("float32", "bfloat16"),
    n_docs: int | None = None,
    repeats: int = 3,
    st_batch_size: int = 32,
    seed: int = 0,
    max_batch_tokens: int | None = None,
    compile: bool = False,
    root: str | os.PathLike | None = None,
    log=print,
    int8: bool = False,
) -> list[DecoderRow]:
    """Rows for each (model, dtype) and engine. ``models``: names in ``MODELS`` or checkpoint directories of decoder
    rerankers; ``n_docs``: documents per query (default: the model's, 16 for qwen3-0.6b, 100 for qwen3-small; 100 for
    a directory). bfloat16 runs only where the CPU has bf16 units. Deltas are taken against sentence-transformers'
    fp32 scores on the same pairs (its last timed fp32 run, or one call where float32 is not asked for). ``int8``
    adds the INT8_ENGINE rows."""
    from sentence_transformers import CrossEncoder

    _, dtypes = _check_run("cpu", dtypes, repeats, 1 if n_docs is None else n_docs)
    models = [models] if isinstance(models, (str, os.PathLike)) else list(models)
    if not models:
        raise ValueError("models must name at least one model")
    for m in models:
        if str(m) not in MODELS and not Path(m).is_dir():
            raise ValueError(f"each model must be one of {sorted(MODELS)} or a checkpoint directory, got {str(m)!r}")
    budget = {} if max_batch_tokens is None else {"max_batch_tokens": whole_number("max_batch_tokens", max_batch_tokens)}
    rows: list[DecoderRow] = []
    for model in models:
        name = str(model)
        path = decoder_reranker(name, root, seed) if name in MODELS else Path(model)
        n = n_docs or (MODELS[name][0] if name in MODELS else 100)
        pairs, check = rerank_pairs(n, seed), accuracy_pairs(n, seed)
        exact = None  # sentence-transformers' fp32 scores on the check pairs
        for dtype in dtypes:
            if dtype == "bfloat16" and not cpu_has_fast_bf16():
                log("skipping bfloat16: this CPU has neither AMX nor AVX512-BF16")
                continue
            if exact is None and dtype != "float32":
                exact = CrossEncoder(str(path), device="cpu").predict(check, activation_fn=torch.nn.Identity(),
                                                                      batch_size=st_batch_size)
            times, outs, checked = _time_engines(path, pairs, dtype, repeats, st_batch_size, budget, compile, check,
                                                 int8=int8)
            measured = _rows(name, dtype, len(pairs), times, outs, checked, exact)
            if dtype == "float32":
                exact = checked[ENGINES[0]]
            for row in measured:
                log(f"{name} {dtype:>8} {row.engine:>21}: {row.pairs_per_s:7.2f} pairs/s  x{row.ratio:.2f}  "
                    f"tokens {row.tokens_computed or '-'}/{row.tokens_total}  max|delta| vs ST fp32 {row.max_abs_delta:.1e}"
                    + (f"  gain {row.measured_gain:.2f}x of {row.ideal_gain:.2f}x ideal ({100 * row.gain_share:.0f}%)"
                       if row.ideal_gain else "")
                    + (f"  error {row.error_ratio:.2f}x ST's own (max {row.max_error_ratio:.2f}x)" if row.error_ratio else "")
                    + (f"  {row.over_sharing:.2f}x sharing on" if row.over_sharing else ""))
            rows += measured
    return rows


def goals(rows: list[DecoderRow]) -> list[tuple[str, str, bool]]:
    """(goal, measured, met) per model and dtype: sharing's share of its ideal gain; in float32 xenc_lab's pairs/s
    over sentence-transformers' and its max |delta| (sharing on); at a 16-bit dtype its error over sentence-transformers'
    own (mean, sharing on)."""
    out = []
    for r in rows:
        if r.engine == INT8_ENGINE and r.model == "qwen3-0.6b":
            per_100 = r.seconds * 100 / r.pairs
            out.append((f"{r.model} {r.dtype}: int8 reranks 1 x 100 in <= {GOALS['int8_seconds_per_100']:.0f} s",
                        f"{per_100:.1f} s ({r.seconds:.2f} s for {r.pairs}), {r.over_sharing:.2f}x sharing on",
                        per_100 <= GOALS["int8_seconds_per_100"]))
        if r.engine != ENGINES[1]:
            continue
        where = f"{r.model} {r.dtype}"
        out.append((f"{where}: sharing gets >= {GOALS['gain_share']:.0%} of the ideal gain",
                    f"{r.measured_gain:.2f}x of {r.ideal_gain:.2f}x = {r.gain_share:.0%}",
                    r.gain_share >= GOALS["gain_share"]))
        if r.dtype == "float32":
            goal = (f"{where}: >= {GOALS['fp32_ratio']:.0f}x sentence-transformers' pairs/s, max |delta| <= "
                    f"{GOALS['fp32_delta']:.0e}")
            out.append((goal, f"{r.ratio:.2f}x, {r.max_abs_delta:.1e}",
                        r.ratio >= GOALS["fp32_ratio"] and r.max_abs_delta <= GOALS["fp32_delta"]))
        elif r.error_ratio:
            out.append((f"{where}: error <= {GOALS['bf16_error_ratio']}x sentence-transformers' own",
                        f"{r.error_ratio:.2f}x (max {r.max_error_ratio:.2f}x)",
                        r.error_ratio <= GOALS["bf16_error_ratio"]))
    return out


def report_section(rows: list[DecoderRow], command: str, machine: str, notes: str = "") -> str:
    """The ``## Decoder rerankers`` section of reports/throughput.md: the rows, and the goals beside what was measured;
    ``notes`` go after the goals."""
    if not rows:
        raise ValueError("no decoder benchmark rows to report")
    bf16 = any(r.dtype != "float32" for r in rows)
    lines = [
        "## Decoder rerankers", "",
        provenance(command, machine), "",
        "One query and N MS MARCO-like passages (`make_pairs(\"short\")` texts) through Qwen3-Reranker's template "
        "(system judging prompt, `<Instruct>`/`<Query>`/`<Document>`, the assistant's empty `<think>` block), scored "
        "by logit(\"yes\") - logit(\"no\") at the last token. Random-weight `" + WORKLOAD_ARCHITECTURE + "` checkpoints built "
        "offline (`xenc_lab.bench.decoder.decoder_reranker`): " + "; ".join(
            f"{m} hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, {c['num_attention_heads']}/"
            f"{c['num_key_value_heads']} heads of {c['head_dim']}, MLP {c['intermediate_size']}"
            for m, (_, c) in MODELS.items() if m in {r.model for r in rows}) + "; tied embeddings, and a byte-level "
        "BPE trained on the workload's vocabulary (words are single tokens; the vocabulary is small, which costs "
        "nothing here: both engines compute the last token's logits only). "
        "Engines in one process, alternating runs, medians: xenc_lab with prefix sharing on and off (the same loaded "
        "model) and sentence-transformers' `CrossEncoder.predict(batch_size=32)` at the same dtype. `tokens computed`: "
        "what xenc_lab's model ran (`Scorer.token_counts`). `ideal gain` = tokens total / tokens "
        "computed with sharing; `gain` = pairs/s sharing on over off; `ratio` = pairs/s over sentence-transformers' "
        "(gain and ratio: the median of the rounds' ratios, each round running the engines back to back). "
        f"`max abs delta`: raw scores against sentence-transformers fp32, on {rows[0].accuracy_pairs} pairs (the "
        "timed ones and more queries' of the same kind: `accuracy_pairs`)."
        + (" `error vs ST's own`: mean abs delta (and max) over sentence-transformers' own at that dtype." if bf16 else "")
        + (f" `{INT8_ENGINE}`: a second model loaded with `quantization=\"int8\"` (docs/int8.md), timed in the same "
           "rounds." if any(r.engine == INT8_ENGINE for r in rows) else ""),
        "",
        "| model | dtype | engine | pairs | tokens total | tokens computed | ideal gain | gain (share) | pairs/s | "
        "ratio | max abs delta |" + (" error vs ST's own |" if bf16 else ""),
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if bf16 else ""),
    ]
    for r in rows:
        gain = (f"{r.ideal_gain:.2f}x | {r.measured_gain:.2f}x ({r.gain_share:.0%})" if r.ideal_gain else " | ")
        error = (f" {r.error_ratio:.2f} (max {r.max_error_ratio:.2f}) |" if r.error_ratio else " |") if bf16 else ""
        lines.append(f"| {r.model} | {r.dtype} | {r.engine} | {r.pairs} | {r.tokens_total} | {r.tokens_computed or '–'} | "
                     f"{gain} | {r.pairs_per_s:.2f} | {r.ratio:.2f}x | {r.max_abs_delta:.1e} |{error}")
    if int8 := [r for r in rows if r.over_sharing]:
        lines += ["", "int8 over xenc_lab sharing on at the same dtype (the median of the rounds' ratios): "
                  + ", ".join(f"{r.over_sharing:.2f}x ({r.model} {r.dtype})" for r in int8) + "."]
    drift = {(r.model, r.dtype): r.oracle_drift for r in rows if r.oracle_drift}
    if drift:
        lines += ["", "sentence-transformers' fp32 scores moved between its timed runs by up to "
                  + ", ".join(f"{d:.1e} ({m})" for (m, _), d in drift.items()) + "."]
    lines += ["", "Goals (the issue's) against what was measured:", ""]
    lines += [f"- {goal}: {value} — {'met' if met else '**missed**'}" for goal, value, met in goals(rows)]
    if notes:
        lines += ["", notes]
    return "\n".join(lines) + "\n"


def as_dicts(rows: list[DecoderRow]) -> list[dict]:
    return [asdict(r) for r in rows]


def plot(rows: list[DecoderRow], ax=None):
    """Bars of pairs/s per (model, dtype), one per engine, each labelled with its ratio to sentence-transformers'. Draws
    on ``ax`` if given, else on a new pyplot figure, and returns the figure."""
    if not rows:
        raise ValueError("no decoder benchmark rows to plot")
    if ax is None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
    else:
        fig = ax.figure
    groups = list(dict.fromkeys((r.model, r.dtype) for r in rows))
    engines = list(dict.fromkeys(r.engine for r in rows))
    width = 0.8 / len(engines)
    for i, engine in enumerate(engines):
        found = [next((r for r in rows if (r.model, r.dtype, r.engine) == (*g, engine)), None) for g in groups]
        bars = ax.bar(np.arange(len(groups)) + i * width, [r.pairs_per_s if r else 0 for r in found], width,
                      label=engine)
        ax.bar_label(bars, [f"{r.ratio:.2f}x" if r else "" for r in found], fontsize=7)
    ax.set_xticks(np.arange(len(groups)) + width * (len(engines) - 1) / 2,
                  [f"{m} {d}\n1 x {next(r.pairs for r in rows if (r.model, r.dtype) == (m, d))}" for m, d in groups])
    ax.set_ylabel("pairs/s")
    ax.set_title("Decoder reranker, 1 query x N documents (higher is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
