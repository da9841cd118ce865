"""``xenc-lab serve`` against requests meant to stall it, over real HTTP on loopback: a request of many wrongly typed
items is refused from its count before any item is looked at, on a worker thread, with an error text linear in its size,
while /health goes on; a body or a request head that stalls or trickles gets 408 and its connection closed; an idle
keep-alive connection is closed; a request past its deadline gets 504 and its queued work is dropped; each is counted in
/metrics. Raw sockets play the stalling clients; every loop is bounded."""
from __future__ import annotations

import json
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_serve import Gate, _post, _wait_queued
from xenc_lab import Scorer
from xenc_lab.serve.app import Limits, create_app
from xenc_lab.serve.errors import describe
from xenc_lab.serve.schemas import ScoreRequest
from xenc_lab.serve.server import ServerThread


def metric(url: str, name: str, **labels) -> float:
    """The value of one sample of GET /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no {name} {labels} in /metrics")


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def read_until_closed(sock: socket.socket, seconds: float = 30) -> bytes:
    """All the server sends until it closes the connection (or ``seconds`` pass: then the test fails)."""
    sock.settimeout(seconds)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.fixture(scope="module")
def served(scorer):
    limits = Limits(body_timeout=1.0)  # the default max_documents (1024) and body size (4 MiB)
    with ServerThread(create_app(scorer, "tiny", limits), timeout_keep_alive=0.5) as server:
        yield server


def test_a_10000_item_bad_request_is_refused_from_its_count_without_validating_an_item(served, monkeypatch):
    validated = []
    real = ScoreRequest.model_validate
    monkeypatch.setattr(ScoreRequest, "model_validate",
                        classmethod(lambda cls, data: validated.append(1) or real(data)))
    def timed(call):
        start = time.monotonic()
        return call(), time.monotonic() - start

    with ThreadPoolExecutor(2) as pool:  # the bad request and a health check at once
        bad = pool.submit(timed, lambda: _post(served.url, "/score", {"queries": "q", "documents": [1] * 10_000}))
        health = pool.submit(timed, lambda: httpx.get(served.url + "/health", timeout=60))
        (response, elapsed), (checked, waited) = bad.result(), health.result()
    assert checked.status_code == 200 and waited < 5  # generous; it waited 11-17 s before
    assert response.status_code == 400
    assert "at most 1024 documents (pairs) per request (--max-documents); got 10000 in documents" in response.text
    assert validated == []  # refused before any item was looked at
    print(f"10,000 bad items refused in {elapsed * 1000:.0f} ms (it took 11-17 s before)")
    assert elapsed < 5  # generous: the count is checked in microseconds; the quadratic text took seconds
    huge = _post(served.url, "/rerank", {"query": "q", "documents": [1] * 1_000_000})  # ~3 MiB, under the body limit
    assert huge.status_code == 400 and "got 1000000 in documents" in huge.text


def test_health_is_answered_while_bad_requests_of_the_largest_allowed_size_are_validated(served):
    """Bad requests at the count limit (1,024 wrong items each) from 4 clients, and /health meanwhile: each health check
    is answered, and before the last bad request is (validation runs on worker threads, not the event loop)."""
    bad = {"queries": "q", "documents": [1] * 1024}
    done, health = [], []

    def flood():
        with httpx.Client(base_url=served.url, timeout=60) as client:
            for _ in range(10):
                response = client.post("/score", json=bad)
                done.append((time.monotonic(), response.status_code, len(response.json()["error"]["message"])))

    with ThreadPoolExecutor(4) as pool:
        floods = [pool.submit(flood) for _ in range(4)]
        with httpx.Client(base_url=served.url, timeout=60) as client:
            for _ in range(5):
                health.append((time.monotonic(), client.get("/health").status_code))
        for f in floods:
            f.result()
    assert [code for _, code in health] == [200] * 5
    assert {code for _, code, _ in done} == {400} and len(done) == 40
    assert health[-1][0] < max(t for t, _, _ in done)  # health was not made to wait for the flood
    assert max(size for _, _, size in done) < 1000  # eight places named, then a count: not 1,024 clauses


def test_the_error_text_is_linear_in_the_number_of_errors():
    errors = [{"type": "string_type", "loc": ("body", "documents", "list[str]", i), "msg": "Input should be a valid "
               "string"} for i in range(50_000)] + [{"type": "string_type", "loc": ("body", "documents", "str"),
                                                      "msg": "Input should be a valid string"}]
    start = time.monotonic()
    text = describe(errors)
    elapsed = time.monotonic() - start
    assert text.startswith("documents[0]: expected a valid string; documents[1]:") and "49992 more places" in text
    assert elapsed < 10  # quadratic, 50,000 errors took minutes


def test_a_body_that_stalls_gets_408_and_its_connection_closed(served):
    before = metric(served.url, "xenc_timeouts_total", kind="body")
    sock = connect(served.url)
    sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                 b'{"text_1": ')
    start = time.monotonic()
    answer = read_until_closed(sock)
    elapsed = time.monotonic() - start
    sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    assert "did not arrive within 1 s" in json.loads(body)["error"]["message"]
    assert 0.9 < elapsed < 20  # it waited for the body, and not much longer
    assert metric(served.url, "xenc_timeouts_total", kind="body") == before + 1


def test_a_body_that_trickles_in_gets_408_too(served):
    sock = connect(served.url)
    sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
    for _ in range(100):  # one byte every 0.1 s: 100 bytes would take 10 s; the server answers after 1 s
        try:
            sock.sendall(b" ")
        except OSError:  # the server closed the connection
            break
        if select.select([sock], [], [], 0.1)[0]:
            break
    answer = read_until_closed(sock)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408")


@pytest.mark.parametrize("sent", [b"", b"POST /score HTTP/1.1\r\nHost: x\r\n"], ids=["nothing", "half a head"])
def test_a_connection_without_a_whole_request_head_gets_408_and_is_closed(served, sent):
    before = metric(served.url, "xenc_timeouts_total", kind="headers")
    sock = connect(served.url)
    sock.sendall(sent)
    answer = read_until_closed(sock)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"no whole request head within 1 s" in answer
    assert metric(served.url, "xenc_timeouts_total", kind="headers") == before + 1


def test_an_idle_keep_alive_connection_is_closed_and_counted(served):
    before = metric(served.url, "xenc_timeouts_total", kind="keep_alive")
    sock = connect(served.url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = read_until_closed(sock)  # the answer, then the close 0.5 s later
    sock.close()
    assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1") == 1
    assert metric(served.url, "xenc_timeouts_total", kind="keep_alive") == before + 1


def test_a_request_past_its_deadline_gets_504_and_its_queued_work_is_dropped(tiny_dir, monkeypatch):
    scorer = Scorer(tiny_dir, device="cpu")
    gate, app = Gate(scorer, monkeypatch), create_app(scorer, "tiny", Limits(request_timeout=1.0))
    with ServerThread(app) as server, ThreadPoolExecutor(2) as pool, gate:
        running = pool.submit(_post, server.url, "/score", {"text_1": "q", "text_2": "running"})
        assert gate.entered.wait(10)
        queued = pool.submit(_post, server.url, "/score", {"text_1": "q", "text_2": "queued"})
        for response in (running.result(), queued.result()):  # both past 1 s: the engine is held
            assert response.status_code == 504 and response.headers["retry-after"] == "1"
            assert "not answered within 1 s (--request-timeout)" in response.json()["error"]["message"]
        _wait_queued(app, 0)
        gate.opened.set()
        assert _post(server.url, "/score", {"text_1": "q", "text_2": "after"}).status_code == 200
        assert metric(server.url, "xenc_timeouts_total", kind="request") == 2
        assert metric(server.url, "xenc_requests_total", route="/score", status="504") == 2
    assert gate.calls == [[("q", "running")], [("q", "after")]]  # the queued one was never scored


def test_limits_are_checked_when_made():
    for bad in (dict(body_timeout=0), dict(request_timeout=-1), dict(body_timeout=True), dict(max_queue=0)):
        with pytest.raises(ValueError, match="must be a positive"):
            Limits(**bad)


def test_the_server_goes_on_after_every_kind_of_timeout(served):
    threads = [threading.Thread(target=lambda: read_until_closed(connect(served.url))) for _ in range(20)]
    for t in threads:  # 20 silent connections at once: each closed after 1 s, none holds the server
        t.start()
    assert httpx.get(served.url + "/health", timeout=30).status_code == 200
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)


def test_past_the_concurrency_limit_a_new_request_gets_503_at_once(scorer):
    with ServerThread(create_app(scorer, "tiny", Limits(body_timeout=5.0)), limit_concurrency=3) as server:
        silent = [connect(server.url) for _ in range(3)]
        try:
            assert httpx.get(server.url + "/health", timeout=30).status_code == 503
        finally:
            for sock in silent:
                sock.close()
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/health", timeout=30).status_code != 200:  # the silent ones are gone
            assert time.monotonic() < deadline
            time.sleep(0.05)
