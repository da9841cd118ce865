"""Scoring a pair table on a local Ray instance: the scores single-process ``Scorer.predict`` gives, every row once
and in order, also when an actor is killed mid-run (Ray restarts it and retries its batch)."""
import os
import signal
import time

import numpy as np
import pandas as pd
import pytest
import torch

ray = pytest.importorskip("ray")

from xenc_lab.distributed import RayScorer, actor_rate, plan_actors, read_table, score_dataset

pytestmark = pytest.mark.slow  # minutes on 2 cores: the edit-test lane leaves it out

ROWS = 100_000
KILL_ROWS = 30_000


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    rng = np.random.default_rng(0)
    words = np.array(["river", "mountain", "query", "passage", "model", "rank", "score", "table", "pair", "cluster", "actor", "batch"])
    frame = pd.DataFrame({
        "id": np.arange(ROWS),
        "text_1": [" ".join(rng.choice(words, 3)) for _ in range(ROWS)],
        "text_2": [" ".join(rng.choice(words, 9)) for _ in range(ROWS)],
    })
    path = tmp_path_factory.mktemp("pairs") / "pairs.parquet"
    frame.to_parquet(path, index=False)
    return path, frame


def _expected(scorer, frame, block, concurrency, **options):
    """Single-process scores of the same rows in the same blocks, with an actor's torch threads (bitwise what the
    actor computes)."""
    import torch

    pairs = list(zip(frame["text_1"], frame["text_2"]))
    before = torch.get_num_threads()
    torch.set_num_threads(plan_actors(concurrency).threads)
    try:
        return np.concatenate([scorer.predict(pairs[i:i + block], **options) for i in range(0, len(pairs), block)])
    finally:
        torch.set_num_threads(before)


def test_a_parquet_table_scored_by_two_actors_gives_single_process_scores_in_order(local_ray, table, tiny_dir, scorer):
    path, frame = table
    start = time.perf_counter()
    scored = score_dataset(str(path), tiny_dir, concurrency=2, batch_size=4096).materialize()
    elapsed = time.perf_counter() - start
    assert scored.num_blocks() == -(-ROWS // 4096)  # one file, cut into a block per actor call: both actors work
    # An actor's rate: its rows over its calls' summed time, which two actors cannot spend in more than 2 x elapsed.
    assert ROWS / actor_rate(scored) <= 2 * elapsed
    out = scored.to_pandas()
    assert list(out.columns) == ["id", "text_1", "text_2", "score"]
    np.testing.assert_array_equal(out["id"].to_numpy(), np.arange(ROWS))  # no row lost, doubled or moved
    np.testing.assert_array_equal(out["score"].to_numpy(), _expected(scorer, frame, 4096, 2))
    assert out["score"].std() > 0.05  # scores that vary: equality is not luck


def test_an_actor_killed_mid_run_is_restarted_and_no_row_is_lost_or_doubled(local_ray, table, tiny_dir, scorer,
                                                                              tmp_path):
    _, frame = table
    frame = frame.iloc[:KILL_ROWS]
    cuts = [0, 1, 1500, 1700, 9100, 20000, KILL_ROWS]  # a folder of uneven files: blocks cut across them
    (tmp_path / "parts").mkdir()
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        frame.iloc[a:b].to_parquet(tmp_path / "parts" / f"part-{i:02d}.parquet", index=False)
    calls, killed = tmp_path / "calls", tmp_path / "killed"

    class KillOnce:
        """The identity as the activation, which SIGKILLs its actor's process in the run's fourth call, before the
        call returns, once: a crash in the middle of the job."""

        def __call__(self, logits):
            with open(calls, "a") as f:
                f.write(".")
            if calls.stat().st_size == 4 and not killed.exists():
                killed.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
            return logits

    out = score_dataset(str(tmp_path / "parts"), tiny_dir, concurrency=2, batch_size=1024,
                        predict_options={"activation_fn": KillOnce()}).to_pandas()
    assert killed.exists(), "no actor was killed"
    assert calls.stat().st_size == -(-KILL_ROWS // 1024) + 1  # every block once, the killed one twice
    np.testing.assert_array_equal(out["id"].to_numpy(), np.arange(KILL_ROWS))
    identity = torch.nn.Identity()
    np.testing.assert_array_equal(out["score"].to_numpy(), _expected(scorer, frame, 1024, 2, activation_fn=identity))


def test_actors_spread_over_the_nodes_cpus_leaving_one_to_reading(local_ray):
    assert plan_actors(1) == plan_actors(1, None, 0, None)
    one, two = plan_actors(1), plan_actors(2)
    assert (one.num_cpus, one.threads) == (1.0, 2)  # the read tasks' CPU is reserved, its time shared
    assert (two.num_cpus, two.threads) == (0.5, 1)
    assert (plan_actors(2, num_cpus=4).num_cpus, plan_actors(2, num_cpus=4).threads) == (4.0, 4)
    assert plan_actors(2, threads=3).threads == 3
    for bad in ({"concurrency": 0}, {"threads": 1.5}, {"num_cpus": -1}, {"num_gpus": "1"}):
        with pytest.raises(ValueError, match="must be"):
            plan_actors(**{"concurrency": 1, **bad})


def test_paths_uris_and_formats(local_ray, table, tmp_path):
    path, frame = table
    assert read_table(f"file://{path}").count() == ROWS
    frame.iloc[:10].to_json(tmp_path / "pairs.txt", orient="records", lines=True)
    assert read_table(tmp_path / "pairs.txt", format="jsonl").count() == 10
    with pytest.raises(ValueError, match="say which with format="):
        read_table(str(tmp_path / "pairs.txt"))
    with pytest.raises(ValueError, match="format must be one of"):
        read_table(str(path), format="xlsx")
    with pytest.raises(FileNotFoundError):
        read_table(str(tmp_path / "nothing.parquet"))


def test_ray_scorer_predicts_like_the_scorer_for_tools_that_take_one(local_ray, tiny_dir, scorer):
    pairs = [(f"query {i}", f"passage number {i} about rivers") for i in range(500)]
    got = RayScorer(tiny_dir, concurrency=1).predict(pairs, max_length=16)
    np.testing.assert_allclose(got, scorer.predict(pairs, max_length=16), rtol=0, atol=1e-6)


def test_bad_arguments_are_refused_before_ray_runs_anything(local_ray, table, tiny_dir):
    path, _ = table
    with pytest.raises(ValueError, match=r"no column\(s\) \['query'\]"):
        score_dataset(str(path), tiny_dir, text_1="query")
    with pytest.raises(ValueError, match="concurrency must be a positive int"):
        score_dataset(str(path), tiny_dir, concurrency=0)
    with pytest.raises(ValueError, match=r"expected a \.parquet, \.jsonl or \.csv file"):
        score_dataset(__file__, tiny_dir)


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".csv"])
def test_score_command_adds_a_score_column_to_a_table_in_this_process(tmp_path, tiny_dir, scorer, suffix):
    from xenc_lab.cli import main
    from xenc_lab.table import read_frame, write_frame

    frame = pd.DataFrame({"q": ["a query", "another"], "d": ["a passage", "more text"], "keep": [7, 8]})
    write_frame(frame, str(tmp_path / f"in{suffix}"))
    argv = ["score", str(tmp_path / f"in{suffix}"), str(tmp_path / f"out{suffix}"), "--model", str(tiny_dir),
            "--text-1", "q", "--text-2", "d", "--device", "cpu"]
    assert main(argv) == 0
    out = read_frame(str(tmp_path / f"out{suffix}"))
    assert list(out["keep"]) == [7, 8]
    np.testing.assert_allclose(out["score"], scorer.predict(list(zip(frame["q"], frame["d"]))), rtol=0, atol=1e-6)
    with pytest.raises(SystemExit):  # OUT exists
        main(argv)


def test_score_command_on_ray_writes_the_scored_table(local_ray, table, tmp_path, tiny_dir, scorer):
    from xenc_lab.cli import main

    path, frame = table
    small = frame.iloc[:2000]
    small.to_parquet(tmp_path / "in.parquet", index=False)
    # OUT, a folder without a suffix, takes IN's format; once there it is refused, then replaced on --overwrite.
    argv = ["score", str(tmp_path / "in.parquet"), str(tmp_path / "scored"), "--model", str(tiny_dir),
            "--ray-address", "local", "--concurrency", "1"]
    assert main(argv) == 0
    with pytest.raises(SystemExit):
        main(argv)
    assert main(argv + ["--overwrite", "--batch-size", "500"]) == 0
    out = pd.read_parquet(tmp_path / "scored")  # a folder of parquet files, read as one table
    np.testing.assert_array_equal(out["id"].to_numpy(), np.arange(2000))  # replaced, not appended to
    np.testing.assert_allclose(out["score"], scorer.predict(list(zip(small["text_1"], small["text_2"]))),
                               rtol=0, atol=1e-6)


def test_rerank_command_on_ray_writes_the_run_one_process_writes(local_ray, tmp_path, tiny_dir):
    from xenc_lab.cli import main
    from xenc_lab.ir import read_run, write_run
    from xenc_lab.ir.pydocs import bm25_run, python_docs_collection

    paths = python_docs_collection(tmp_path, max_chars=200, max_queries=8)
    write_run(bm25_run(paths["queries"], paths["corpus"], k=12), tmp_path / "bm25.trec", tag="bm25")
    runs = {}
    for where in ("here", "ray"):
        argv = ["rerank", "--model", str(tiny_dir), "--beir", str(tmp_path), "--run", str(tmp_path / "bm25.trec"),
                "--depth", "10", "--output", str(tmp_path / f"{where}.trec"), "--device", "cpu"]
        assert main(argv + (["--ray-address", "local"] if where == "ray" else [])) == 0
        runs[where] = read_run(tmp_path / f"{where}.trec")
    assert runs["ray"]["qid"].nunique() == 8
    assert runs["ray"][["qid", "docno", "rank"]].equals(runs["here"][["qid", "docno", "rank"]])
    np.testing.assert_allclose(runs["ray"]["score"], runs["here"]["score"], rtol=0, atol=1e-6)
