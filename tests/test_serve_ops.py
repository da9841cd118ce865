"""``xenc-lab serve`` as operators run it, over real HTTP on loopback: the API key (every route but /health answers 401
without it; the key never reaches a log), /metrics in Prometheus' text format, one access-log line per request, TLS
through uvicorn's options, and a graceful shutdown on SIGTERM (the request in flight is answered, queued ones get 503,
the process ends after its shutdown), the last two in a server process of their own."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.test_serve import _post, scores_of
from tests.test_serve_limits import metric
from xenc_lab.serve.app import create_app
from xenc_lab.serve.server import ServerThread

ROOT = Path(__file__).resolve().parents[1]
KEY = "k-3f9a1c77-never-logged"
SCORE = {"text_1": "how tall is everest", "text_2": ["Everest is 8,849 m high.", "Paris is in France.", "q"]}


@pytest.fixture(scope="module")
def keyed(scorer):
    with ServerThread(create_app(scorer, "tiny", api_key=KEY)) as server:
        yield server


@pytest.mark.parametrize("method, path", [("POST", "/score"), ("POST", "/v1/score"), ("POST", "/rerank"),
                                          ("POST", "/v2/rerank"), ("GET", "/v1/models"), ("GET", "/metrics"),
                                          ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no/such/path")])
def test_every_route_but_health_needs_the_key(keyed, method, path):
    body = SCORE if "score" in path else {"query": "q", "documents": ["d"]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": f"Bearer {KEY}x"}):
        response = httpx.request(method, keyed.url + path, json=body if method == "POST" else None, headers=headers)
        assert response.status_code == 401, (headers, response.text)
        assert response.headers["www-authenticate"] == "Bearer" and KEY not in response.text
        assert response.json()["error"]["code"] == 401
    right = httpx.request(method, keyed.url + path, json=body if method == "POST" else None,
                          headers={"Authorization": f"Bearer {KEY}"})
    assert right.status_code == (404 if path == "/no/such/path" else 200), right.text


def test_health_needs_no_key(keyed):
    assert httpx.get(keyed.url + "/health").status_code == 200


def test_an_empty_key_is_refused_at_start(scorer):
    with pytest.raises(ValueError, match="non-empty string"):
        create_app(scorer, api_key="")


def test_metrics_count_requests_pairs_tokens_and_engine_calls_in_prometheus_text(scorer):
    with ServerThread(create_app(scorer, "tiny")) as server:  # a fresh app: its own registry, from zero
        ok = _post(server.url, "/score", SCORE)
        assert _post(server.url, "/score", {"text_1": 5}).status_code == 400
        assert httpx.get(server.url + "/nothing/here").status_code == 404
        response = httpx.get(server.url + "/metrics")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        tokens = ok.json()["usage"]["prompt_tokens"]
        assert metric(server.url, "xenc_requests_total", route="/score", status="200") == 1
        assert metric(server.url, "xenc_requests_total", route="/score", status="400") == 1
        assert metric(server.url, "xenc_requests_total", route="other", status="404") == 1  # no label per path
        assert metric(server.url, "xenc_request_duration_seconds_count", route="/score") == 2
        assert metric(server.url, "xenc_pairs_scored_total") == 3
        assert metric(server.url, "xenc_prompt_tokens_total") == tokens
        assert metric(server.url, "xenc_tokens_computed_total") == tokens  # an encoder runs every token
        assert metric(server.url, "xenc_engine_batch_pairs_count") == 1
        assert metric(server.url, "xenc_engine_batch_pairs_sum") == 3
        assert metric(server.url, "xenc_engine_batch_requests_sum") == 1
        assert metric(server.url, "xenc_queue_depth") == 0
        for kind in ("body", "request", "headers", "keep_alive"):
            assert metric(server.url, "xenc_timeouts_total", kind=kind) == 0


def test_a_decoders_computed_tokens_are_fewer_than_its_prompt_tokens_in_metrics(tmp_path_factory):
    from xenc_lab.zoo.decoders import build_decoder
    from xenc_lab import Scorer

    scorer = Scorer(build_decoder("qwen3-reranker", tmp_path_factory.mktemp("decoder")), device="cpu")
    with ServerThread(create_app(scorer, "qwen3")) as server:
        response = _post(server.url, "/rerank", {"query": "where do rivers start",
                                                 "documents": [f"passage {i} about rivers" for i in range(8)]})
        total, computed = scorer.token_counts.total, scorer.token_counts.computed
        assert response.json()["usage"]["prompt_tokens"] == total
        assert metric(server.url, "xenc_prompt_tokens_total") == total
        assert metric(server.url, "xenc_tokens_computed_total") == computed < total / 2  # the query's prefix once


def test_each_request_gets_one_structured_access_log_line(scorer, caplog):
    with caplog.at_level(logging.INFO, "xenc_lab.serve.access"), ServerThread(create_app(scorer, "tiny")) as server:
        ok = _post(server.url, "/score", SCORE)
        _post(server.url, "/rerank", {"query": "q", "documents": "not a list, one document"})
        httpx.get(server.url + "/health")
        _post(server.url, "/score", {"text_1": 5})
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "xenc_lab.serve.access"]
    assert [(line["method"], line["route"], line["status"]) for line in lines] == [
        ("POST", "/score", 200), ("POST", "/rerank", 200), ("GET", "/health", 200), ("POST", "/score", 400)]
    assert lines[0]["pairs"] == 3 and lines[0]["tokens"] == ok.json()["usage"]["prompt_tokens"]
    assert lines[1]["pairs"] == 1 and lines[2]["pairs"] is None and lines[3]["pairs"] is None
    assert all(line["ms"] >= 0 and line["client"].startswith("127.0.0.1:") for line in lines)


def test_tls_is_uvicorns_key_and_certificate(scorer, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    try:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    except (FileNotFoundError, subprocess.CalledProcessError) as err:
        pytest.skip(f"no openssl to make a certificate: {err}")
    with ServerThread(create_app(scorer, "tiny"), ssl_keyfile=str(key), ssl_certfile=str(cert)) as server:
        assert server.url.startswith("https://127.0.0.1:")
        assert np.array_equal(scores_of(httpx.post(server.url + "/score", json=SCORE, verify=str(cert))),
                              scorer.predict(list(zip([SCORE["text_1"]] * 3, SCORE["text_2"]))))
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url.replace("https", "http") + "/health", timeout=10)


class Process:
    """A server process; its output lines gathered on a thread (bounded by the process's life)."""

    def __init__(self, args: list[str], env: dict | None = None):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def wait_for(self, text: str, seconds: float = 180) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if found := next((line for line in list(self.lines) if text in line), None):
                return found
            assert self.proc.poll() is None, "".join(self.lines)
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} in {seconds} s: {''.join(self.lines)}")

    def stop(self, seconds: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(seconds)
        finally:
            self.proc.kill()


# uvicorn shuts down, then raises the signal it caught again: the process ends as SIGTERM ends one, having finished
STOPPED = -signal.SIGTERM


def test_the_key_from_the_environment_guards_the_served_command_and_never_reaches_its_logs(tiny_dir):
    server = Process(["-m", "xenc_lab.cli", "serve", str(tiny_dir), "--device", "cpu", "--port", "0", "--log-level",
                      "debug", "--served-model-name", "tiny"], env={"XENC_LAB_API_KEY": KEY})
    try:
        url = server.wait_for("Uvicorn running on").split("running on ")[1].split()[0]
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.post(url + "/score", json=SCORE).status_code == 401
        near = {"Authorization": f"Bearer {KEY[:-1]}"}
        assert httpx.post(url + "/score", json=SCORE, headers=near).status_code == 401
        assert httpx.post(url + "/score", json=SCORE, headers=auth).status_code == 200
        assert "xenc_pairs_scored_total 3.0" in httpx.get(url + "/metrics", headers=auth).text
    finally:
        assert server.stop() == STOPPED
    output = "".join(server.lines)
    assert KEY not in output and KEY[:-1] not in output
    access = [json.loads(line.split("xenc_lab.serve.access: ")[1]) for line in server.lines
              if "xenc_lab.serve.access: " in line]
    assert [(a["route"], a["status"]) for a in access] == [("/health", 200), ("/score", 401), ("/score", 401),
                                                           ("/score", 200), ("/metrics", 200)]


HELD_SERVER = """
import os, socket, sys, time
from xenc_lab import Scorer
from xenc_lab.serve.app import create_app
from xenc_lab.serve.server import Server, config_for

tiny, port_file, entered, release = sys.argv[1:5]
scorer = Scorer(tiny, device="cpu")
predict = scorer.predict

def held(pairs, **kwargs):  # the engine holds its first call until the test lets it go (60 s at most)
    open(entered, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.01)
    return predict(pairs, **kwargs)

scorer.predict = held
app = create_app(scorer, "tiny")
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
with open(port_file + ".part", "w") as f:
    f.write(str(sock.getsockname()[1]))
os.replace(port_file + ".part", port_file)
Server(config_for(app, log_level="info"), app).run(sockets=[sock])
"""


def _wait_file(path: Path, server: Process, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline and server.proc.poll() is None, "".join(server.lines)
        time.sleep(0.02)


def test_sigterm_answers_the_request_in_flight_gives_queued_ones_503_and_then_exits(tiny_dir, scorer, tmp_path):
    port_file, entered, release = tmp_path / "port", tmp_path / "entered", tmp_path / "release"
    server = Process(["-c", HELD_SERVER, str(tiny_dir), str(port_file), str(entered), str(release)])
    try:
        _wait_file(port_file, server)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        server.wait_for("Application startup complete")
        with ThreadPoolExecutor(3) as pool:
            in_flight = pool.submit(_post, url, "/score", {"text_1": "q", "text_2": ["in", "flight"]})
            _wait_file(entered, server, 60)
            queued = [pool.submit(_post, url, "/score", {"text_1": "q", "text_2": "queued"}),
                      pool.submit(_post, url, "/rerank", {"query": "q", "documents": ["queued", "too"]})]
            deadline = time.monotonic() + 60
            while metric(url, "xenc_queue_depth") < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            server.proc.send_signal(signal.SIGTERM)
            for response in (f.result(60) for f in queued):  # answered at once, the engine still held
                assert response.status_code == 503 and response.headers["retry-after"] == "1"
                assert response.json()["error"]["message"] == "the server is shutting down"
            assert not in_flight.done()
            release.touch()
            answered = in_flight.result(60)
        assert np.array_equal(scores_of(answered), scorer.predict([("q", "in"), ("q", "flight")]))
        assert server.proc.wait(60) == STOPPED
    finally:
        release.touch()
        server.proc.kill()
    output = "".join(server.lines)
    assert "Shutting down" in output and "Finished server process" in output and "Traceback" not in output
