"""Cross-client batching under load: the batcher's rules on a recording stand-in for the Scorer (which requests share a
call, in what order, and who hears of an error), then 32 concurrent HTTP clients for a few seconds against the tiny
model, every answer checked against its own pairs' scores."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tests.conftest import PAIRS
from xenc_lab.bench.workloads import make_pairs
from xenc_lab.serve.app import Limits, create_app
from xenc_lab.serve.batcher import Batcher, QueueFull
from xenc_lab.serve.bench import LoadResult, drive, report_section, score_bodies
from xenc_lab.serve.server import ServerThread

pytestmark = pytest.mark.slow  # minutes on 2 cores: the edit-test lane leaves it out


class Panic(BaseException):
    """What a Rust panic in the tokenizer raises (pyo3's PanicException derives from BaseException)."""


class Recorder:
    """A Scorer stand-in: a pair's score is its second text's length (its negative without the activation); a pair
    whose text is "bad" is refused as the Scorer refuses bad input. Holds its calls until ``opened``."""

    def __init__(self):
        self.calls, self.opened = [], threading.Event()

    def predict(self, pairs, *, max_length=None, activation_fn=None, show_progress_bar=None):
        self.calls.append((list(pairs), max_length, activation_fn is None))
        assert self.opened.wait(10)
        if any("bad" in pair for pair in pairs):
            raise ValueError("pairs hold a bad text")
        if any("panic" in pair for pair in pairs):
            raise Panic("a Rust panic")
        sign = 1.0 if activation_fn is None else -1.0
        return np.array([sign * len(d) for _, d in pairs], dtype=np.float32)


def pairs_of(*docs):
    return [("q", d) for d in docs]


@pytest.fixture
def batcher():
    recorder = Recorder()
    batcher = Batcher(recorder, max_queue=8, max_batch_pairs=6)
    batcher.start()
    yield batcher
    recorder.opened.set()
    batcher.close()


def hold_engine(batcher):
    """Submit a request and wait until its call holds the worker: later ones queue."""
    first = batcher.submit(pairs_of("held"), None, True)
    deadline = time.monotonic() + 10
    while not batcher.scorer.calls:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return first


def test_queued_requests_with_equal_options_share_a_call_up_to_the_pair_cap_oldest_first(batcher):
    hold_engine(batcher)
    a = batcher.submit(pairs_of("a1", "a22"), None, True)
    b = batcher.submit(pairs_of("b"), 16, True)  # other max_length: a call of its own
    c = batcher.submit(pairs_of("c333", "c4444", "c5"), None, True)
    d = batcher.submit(pairs_of("d", "d"), None, True)  # would pass the cap of 6 pairs with a and c
    e = batcher.submit(pairs_of("e"), None, False)  # raw logits: a call of its own
    batcher.scorer.opened.set()
    assert list(a.result(10)) == [2, 3] and list(c.result(10)) == [4, 5, 2] and list(d.result(10)) == [1, 1]
    assert list(b.result(10)) == [1] and list(e.result(10)) == [-1]
    calls = [([doc for _, doc in pairs], max_length, activated) for pairs, max_length, activated in batcher.scorer.calls]
    assert calls == [(["held"], None, True), (["a1", "a22", "c333", "c4444", "c5"], None, True), (["b"], 16, True),
                     (["d", "d"], None, True), (["e"], None, False)]
    assert (batcher.calls, batcher.requests, batcher.pairs) == (5, 6, 10)


def test_a_refused_request_fails_alone_and_its_batchmates_get_their_scores(batcher):
    hold_engine(batcher)
    good = batcher.submit(pairs_of("good"), None, True)
    bad = batcher.submit(pairs_of("x", "bad"), None, True)
    also = batcher.submit(pairs_of("fine"), None, True)
    batcher.scorer.opened.set()
    assert list(good.result(10)) == [4] and list(also.result(10)) == [4]
    with pytest.raises(ValueError, match="bad text"):
        bad.result(10)


def test_an_engine_failure_reaches_each_request_of_its_call_and_the_worker_lives_on(batcher):
    hold_engine(batcher)
    first = batcher.submit(pairs_of("one"), None, True)
    second = batcher.submit(pairs_of("panic"), None, True)
    batcher.scorer.opened.set()
    for future in (first, second):
        with pytest.raises(RuntimeError, match="the engine failed: Panic"):
            future.result(10)
    assert list(batcher.submit(pairs_of("after"), None, True).result(10)) == [5] and batcher.alive


def test_a_request_given_up_before_its_call_is_never_scored_and_a_full_queue_refuses(batcher):
    hold_engine(batcher)
    gone = batcher.submit(pairs_of("gone"), None, True)
    kept = [batcher.submit(pairs_of(f"k{i}"), None, True) for i in range(batcher.max_queue - 1)]
    with pytest.raises(QueueFull, match="8 requests are queued"):
        batcher.submit(pairs_of("one too many"), None, True)
    assert gone.cancel()
    batcher.scorer.opened.set()
    assert [list(k.result(10)) for k in kept] == [[2]] * len(kept)
    assert all("gone" not in {d for _, d in pairs} for pairs, _, _ in batcher.scorer.calls)


def test_closing_fails_the_queued_requests_instead_of_leaving_them_waiting(batcher):
    hold_engine(batcher)
    queued = batcher.submit(pairs_of("queued"), None, True)
    threading.Timer(0.05, batcher.scorer.opened.set).start()
    batcher.close()
    with pytest.raises(RuntimeError, match="shutting down"):
        queued.result(10)
    assert not batcher.alive


def test_32_concurrent_clients_each_get_their_own_scores_and_their_requests_share_calls(scorer):
    """3 s of 32 clients posting /score requests of 1 to 16 pairs: no failure, every answer its own pairs' scores,
    and fewer engine calls than requests (which requests share a call is tested exactly above and in test_serve)."""
    pairs = PAIRS + make_pairs("mixed", 183, seed=5)
    bodies = score_bodies(pairs, docs=16) + score_bodies(pairs[:40], docs=1) + score_bodies(pairs[:21], docs=7)
    sizes = np.cumsum([len(b["text_1"]) for b in bodies])[:-1]
    expected = np.split(scorer.predict([p for b in bodies for p in zip(b["text_1"], b["text_2"])]), sizes)
    app = create_app(scorer, "tiny", Limits(max_queue=64))
    with ServerThread(app) as server:
        result = drive(server.url, bodies, expected, clients=32, seconds=3.0, tol=1e-5)
        batcher = app.state.batcher
    print(f"{result.requests} requests, {result.pairs_per_s:.0f} pairs/s, p95 {result.latency_ms(0.95):.0f} ms, "
          f"{batcher.requests / batcher.calls:.1f} requests per call")
    assert result.failed == 0 and result.mismatched == 0, result.errors
    assert result.requests >= 64
    # calls carried several clients' requests (how many depends on the machine: the tiny model's calls are short)
    assert batcher.calls < batcher.requests


def test_the_serving_section_reports_the_ratios_and_replaces_only_itself_in_the_report(tmp_path):
    from xenc_lab.bench.report import append_section

    result = LoadResult(seconds=10.0, requests=50, failed=1, mismatched=1, pairs=800, latencies=[0.1, 0.2, 0.3])
    row = {"model": "m", "dtype": "float32", "clients": 32, "seconds": 10.0, "rounds": 2, "workload": "short",
           "result": result, "served": 80.0, "offline_all": 100.0, "offline_each": 40.0, "requests_per_call": 12.5,
           "load": (0.5, 1.5)}
    report = tmp_path / "throughput.md"
    report.write_text("# Throughput\n\n## Serving\n\nold numbers\n\n## Decoder rerankers\n\nkept\n")
    append_section(report, report_section(row, "xenc-lab bench --serve", "a machine"))
    text = report.read_text()
    assert "old numbers" not in text and text.startswith("# Throughput\n\n## Serving\n")
    assert text.endswith("## Decoder rerankers\n\nkept\n")
    assert "| m | float32 | 32 | 50 | 2 | 80.0 | 100.0 | 0.80x | 40.0 | 2.00x | 200 / 290 ms | 12.5 |" in text
