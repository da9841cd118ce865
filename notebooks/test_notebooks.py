"""Every notebook runs top to bottom and shows the figures and tables it is there for, so none can rot; and what its
text states is true of its outputs. Each number or comparison a notebook's markdown states about its results is
asserted in the code cell that computes it, so a run whose outputs contradict the text fails here. The stored outputs
are a complete run (``xenc-lab report notebooks``) with no frozen progress bars and a plain-text rendering of every
table."""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from xenc_lab.report import PROGRESS, WIDGET

HERE = Path(__file__).parent
NOTEBOOKS = sorted(HERE.glob("*.ipynb"))

TABLE, FIGURE = "text/html", "image/png"  # a DataFrame's display, a matplotlib figure's

# What each notebook is there to show, in order: (text of the code cell that shows it, what it shows).
SHOWS = {
    "01_quickstart.ipynb": [
        ("pd.DataFrame(ranking)", TABLE),  # rank()
        ('table["|delta|"] = ', TABLE),  # side by side with sentence-transformers
        ("ax.scatter(theirs, ours", FIGURE),  # a workload's scores, ours against the oracle's
        ("bench.as_dicts(rows)", TABLE),  # throughput on one's own pairs
    ],
    "02_speed_and_precision.ipynb": [
        ("table = pd.DataFrame(bench.as_dicts(rows))", TABLE),  # throughput, side by side
        ("bench.plot(rows)", FIGURE),  # the report's figure
        ("ax.hist(", FIGURE),  # bf16 errors, both engines
    ],
    "03_decoder_rerankers.ipynb": [
        ('table["|delta|"] = ', TABLE),  # a decoder's scores beside sentence-transformers'
        ("pd.DataFrame(ranking)", TABLE),  # rank() on a 1:N example
        ("counts = pd.DataFrame(counts)", TABLE),  # the tokens sharing saves
        ("decoder.plot(rows)", FIGURE),  # pairs/s sharing on vs off vs sentence-transformers
    ],
    "04_reranking_experiment.ipynb": [
        ("corpus.sample(", TABLE),  # the collection's documents
        ("qrels.assign(query=", TABLE),  # its held-out queries and their one relevant document
        ('write_run(run, folder / "bm25.trec"', TABLE),  # the BM25 first stage
        ("reranked = rerank(", TABLE),  # the reranked run
        ("table = experiment(", TABLE),  # first stage vs reranked, pt.Experiment's table
        ("tests = significance(", TABLE),  # paired t-test and randomization test
        ("per_query = pd.concat(", TABLE),  # the queries that moved most
        ("summarize_comparison(head)", TABLE),  # how much the rankings differ
        ('head.sort_values("kendall_tau")', TABLE),  # the most reordered queries
        ("right.hist(", FIGURE),  # per-query nDCG@10 before/after, Kendall's tau
    ],
    "05_precision_and_rankings.ipynb": [
        ("deltas = result.score_deltas()", TABLE),  # |score delta| of each setting against fp32
        ("tokens = Scorer(model).tokenizer(", FIGURE),  # bf16 against fp32; |delta| against pair length
        ("result.rankings(k=10)", TABLE),  # Kendall's tau, top-10 overlap, same top 10
        ("neighbors = result.neighbor_swaps(", FIGURE),  # tau per query; bf16 swaps near ties only
        ("metrics = result.metrics(", TABLE),  # metric deltas with paired tests
        ("moved = pd.concat(", TABLE),  # the queries behind the metric deltas
        ("fig = result.plot(", FIGURE),  # the three levels in one figure
    ],
    "06_scale_out_with_ray.ipynb": [
        ("table.head(3)", TABLE),  # the pair table written to parquet
        ("plans = pd.DataFrame(", TABLE),  # what each actor asks of Ray, and its threads
        ("checks = pd.DataFrame(checks).T", TABLE),  # every row once, in order, the one process's scores
        ("speed = pd.DataFrame(", TABLE),  # pairs/s: one process, 1 actor, 2 actors; per worker
        ("left.step(", FIGURE),  # rows over time (start-up), pairs/s while scoring
    ],
}
# Code cells after the last figure or table: 01 ends in its throughput table; in 02 the compile and GPU sections,
# which print text, follow the bf16 histogram; 06 stops its Ray cluster after its figure.
TRAILING_TEXT_CELLS = {"01_quickstart.ipynb": 0, "02_speed_and_precision.ipynb": 2, "03_decoder_rerankers.ipynb": 0,
                       "04_reranking_experiment.ipynb": 0, "05_precision_and_rankings.ipynb": 0,
                       "06_scale_out_with_ray.ipynb": 1}


def test_the_glob_finds_exactly_the_notebooks_that_are_checked():
    assert [p.name for p in NOTEBOOKS] == sorted(SHOWS) == sorted(TRAILING_TEXT_CELLS)


def check_executed(nb, name: str) -> None:
    """Every code cell ran, in order, and each figure and table in SHOWS[name] is in its cell's outputs."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{name} has no code cells"
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), f"{name}: a code cell did not run"
    shown = [i for i, c in enumerate(code) if any(m in o.get("data", {}) for o in c.outputs for m in (TABLE, FIGURE))]
    for text, mime in SHOWS[name]:
        cells = [c for c in code if text in c.source]
        assert len(cells) == 1, f"{name}: {len(cells)} code cells hold {text!r}, expected one"
        outputs = [o for o in cells[0].outputs if mime in o.get("data", {})]
        assert outputs and all(o["data"][mime] for o in outputs), f"{name}: the cell with {text!r} shows no {mime}"
    assert shown and shown[-1] == len(code) - 1 - TRAILING_TEXT_CELLS[name], (
        f"{name}: its last figure or table is in code cell {shown[-1] + 1 if shown else None} of {len(code)}")


@pytest.mark.parametrize("name", sorted(SHOWS))
def test_stored_outputs_are_a_complete_run_with_every_figure_and_table(name):
    check_executed(nbformat.read(HERE / name, as_version=4), name)


@pytest.mark.parametrize("name", sorted(SHOWS))
def test_stored_outputs_hold_no_progress_bar_and_every_table_reads_as_text(name):
    nb = nbformat.read(HERE / name, as_version=4)
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        for output in cell.outputs:
            data = output.get("data", {})
            text = output.get("text", "") or data.get("text/plain", "")
            assert WIDGET not in data, f"{name}, code cell {i + 1}: a progress-bar widget is stored"
            assert not PROGRESS.search(text.replace("\r", "\n")), f"{name}, code cell {i + 1}: a progress bar is stored"
            # A pandas Styler shows only in HTML; its text/plain is its repr, which says nothing outside a browser.
            assert not text.startswith("<pandas.io.formats.style.Styler"), (
                f"{name}, code cell {i + 1}: a styled table with no plain-text rendering")


@pytest.mark.parametrize("name", sorted(SHOWS))
def test_notebook_runs_every_cell_and_shows_its_figures_and_tables(name):
    path = HERE / name
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    check_executed(nb, name)
