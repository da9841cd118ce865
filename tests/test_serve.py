"""``xenc-lab serve`` over real HTTP: a uvicorn server on a free loopback port in a background thread, httpx as the
client. Served scores equal ``Scorer.predict``'s on the same pairs, bit for bit; every request shape of vLLM's score and
rerank APIs is answered; bad input gets 4xx with a JSON error saying what was expected, never a 5xx (schemathesis
fuzzes the OpenAPI schema); a full queue gets 503 with Retry-After; queued requests share predict calls."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import PAIRS
from xenc_lab import Scorer
from xenc_lab.serve.app import Limits, create_app
from xenc_lab.serve.server import ServerThread

LIMITS = Limits(max_documents=16, max_request_bytes=32 * 1024, max_queue=64)


@pytest.fixture(scope="module")
def served(scorer):
    with ServerThread(create_app(scorer, "tiny", LIMITS)) as server:
        yield server


@pytest.fixture(scope="module")
def client(served):
    with httpx.Client(base_url=served.url, timeout=30) as client:
        yield client


def tokens(scorer, pairs, max_length=None) -> int:
    return int(scorer.tokenizer([a for a, _ in pairs], [b for _, b in pairs], max_length).lengths.sum())


def scores_of(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data))) and {d["object"] for d in data} == {"score"}
    return np.array([d["score"] for d in data], dtype=np.float32)


QUERY, DOCS = PAIRS[0][0], [d for _, d in PAIRS]
SHAPES = {
    "1:1 strings": ({"text_1": QUERY, "text_2": DOCS[0]}, [(QUERY, DOCS[0])]),
    "1:N string": ({"text_1": QUERY, "text_2": DOCS}, [(QUERY, d) for d in DOCS]),
    "1:N list of one": ({"text_1": [QUERY], "text_2": DOCS}, [(QUERY, d) for d in DOCS]),
    "N:N text": ({"text_1": [q for q, _ in PAIRS], "text_2": DOCS}, PAIRS),
    "N:N data": ({"data_1": [q for q, _ in PAIRS], "data_2": DOCS}, PAIRS),
    "queries/documents": ({"queries": [q for q, _ in PAIRS], "documents": DOCS}, PAIRS),
    "queries/items": ({"queries": QUERY, "items": DOCS[:3]}, [(QUERY, d) for d in DOCS[:3]]),
}


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
@pytest.mark.parametrize("shape", SHAPES)
def test_every_score_shape_gets_predicts_scores_bit_for_bit_and_the_tokens_as_tokenized(client, scorer, path, shape):
    body, pairs = SHAPES[shape]
    response = client.post(path, json={"model": "tiny", **body})
    got, expected = scores_of(response), scorer.predict(pairs)
    print(f"{shape}: max |served - predict| = {np.abs(got - expected).max():.1e}")
    assert np.array_equal(got, expected)
    out = response.json()
    assert out["object"] == "list" and out["model"] == "tiny" and out["id"].startswith("score-")
    assert isinstance(out["created"], int) and abs(out["created"] - time.time()) < 60
    assert out["usage"] == {"prompt_tokens": tokens(scorer, pairs), "total_tokens": tokens(scorer, pairs),
                            "completion_tokens": 0}


def test_use_activation_false_gives_the_raw_logits_and_the_old_names_work_too(client, scorer):
    raw = scorer.predict(PAIRS, activation_fn=torch.nn.Identity())
    body = {"text_1": [q for q, _ in PAIRS], "text_2": DOCS}
    for flag in ({"use_activation": False}, {"activation": False}, {"softmax": False}):
        assert np.array_equal(scores_of(client.post("/score", json={**body, **flag})), raw)
    activated = scores_of(client.post("/score", json={**body, "use_activation": True}))
    assert np.array_equal(activated, scorer.predict(PAIRS))
    assert np.allclose(activated, 1 / (1 + np.exp(-raw.astype(np.float64))), atol=1e-6)  # the tiny model's sigmoid


def test_truncate_prompt_tokens_is_predicts_max_length_and_minus_one_the_models_own(client, scorer):
    body = {"text_1": [q for q, _ in PAIRS], "text_2": DOCS}
    short = client.post("/score", json={**body, "truncate_prompt_tokens": 16})
    assert np.array_equal(scores_of(short), scorer.predict(PAIRS, max_length=16))
    assert short.json()["usage"]["prompt_tokens"] == tokens(scorer, PAIRS, 16) <= 16 * len(PAIRS)
    whole = client.post("/score", json={**body, "truncate_prompt_tokens": -1})
    assert np.array_equal(scores_of(whole), scorer.predict(PAIRS))


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_as_scorer_rank_does_and_honours_top_n_and_return_documents(client, scorer, path):
    ranked = scorer.rank(QUERY, DOCS)
    response = client.post(path, json={"query": QUERY, "documents": DOCS, "model": "tiny"})
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["id"].startswith("rerank-") and out["model"] == "tiny"
    assert [r["index"] for r in out["results"]] == [r["corpus_id"] for r in ranked]
    assert [r["relevance_score"] for r in out["results"]] == [np.float32(r["score"]).item() for r in ranked]
    assert [r["document"]["text"] for r in out["results"]] == [DOCS[r["corpus_id"]] for r in ranked]
    n = tokens(scorer, [(QUERY, d) for d in DOCS])
    assert out["usage"] == {"prompt_tokens": n, "total_tokens": n}
    top = client.post(path, json={"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False}).json()
    assert [r["index"] for r in top["results"]] == [r["corpus_id"] for r in ranked[:2]]
    assert all(set(r) == {"index", "relevance_score"} for r in top["results"])


def test_a_saves_default_prompt_is_scored_and_counted_as_predict_prepends_it(tmp_path, tiny_dir, scorer):
    from sentence_transformers import CrossEncoder

    CrossEncoder(str(tiny_dir), device="cpu", prompts={"query": "query: "}, default_prompt_name="query"
                 ).save_pretrained(str(tmp_path / "prompted"))
    prompted = Scorer(tmp_path / "prompted", device="cpu")
    with ServerThread(create_app(prompted, "prompted")) as server:
        response = _post(server.url, "/score", {"text_1": [q for q, _ in PAIRS], "text_2": DOCS})
    assert np.array_equal(scores_of(response), prompted.predict(PAIRS))
    with_prompt = [("query: " + q, d) for q, d in PAIRS]
    assert response.json()["usage"]["prompt_tokens"] == tokens(scorer, with_prompt) > tokens(scorer, PAIRS)


def test_health_and_models_describe_the_one_served_model(client, scorer):
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == scorer.max_length == 64
    schema = client.get("/openapi.json").json()
    assert {"/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/health", "/v1/models"} <= set(schema["paths"])


JSON = {"content-type": "application/json"}
ERRORS = {
    "malformed JSON": (dict(content=b'{"text_1": "a", ', headers=JSON), 400, "not valid JSON"),
    "empty body": (dict(content=b"", headers=JSON), 400, "expected a JSON object"),
    "a list body": (dict(json=[["q", "d"]]), 400, "expected a JSON object"),
    "a number text": (dict(json={"text_1": 5, "text_2": "d"}), 400, "text_1: expected a valid string or"),
    "a number in a list": (dict(json={"text_1": "q", "text_2": ["d", 7]}), 400, "text_2[1]: expected a valid string"),
    "a string flag": (dict(json={"text_1": "q", "text_2": "d", "use_activation": "yes"}), 400, "use_activation"),
    "one side": (dict(json={"text_1": "q"}), 400, "expected exactly one pair of sides"),
    "two pairs of sides": (dict(json={"text_1": "q", "text_2": "d", "queries": "q", "documents": "d"}), 400,
                           "expected exactly one pair of sides"),
    "N:M": (dict(json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}), 400, "1:1, 1:N or N:N; got 2 and 3"),
    "N:1": (dict(json={"text_1": ["a", "b"], "text_2": "c"}), 400, "1:1, 1:N or N:N; got 2 and 1"),
    "an empty side": (dict(json={"text_1": "q", "text_2": []}), 400, "at least one text"),
    "too many documents": (dict(json={"text_1": "q", "text_2": ["d"] * 17}), 400, "at most 16 documents"),
    "another model": (dict(json={"model": "gpt-4", "text_1": "q", "text_2": "d"}), 404,
                      "The model `gpt-4` does not exist."),
    "truncation too large": (dict(json={"text_1": "q", "text_2": "d", "truncate_prompt_tokens": 65}), 400,
                             "greater than max_model_len (64). Please, select a smaller truncation size."),
    "truncation under the special tokens": (dict(json={"text_1": "q", "text_2": "d", "truncate_prompt_tokens": 2}),
                                            400, "cannot hold the 3 special tokens"),
    "truncation below -1": (dict(json={"text_1": "q", "text_2": "d", "truncate_prompt_tokens": -2}), 400,
                            "greater than or equal to -1"),
    "an unsupported vLLM field": (dict(json={"text_1": "q", "text_2": "d", "max_tokens_per_doc": 8}), 400,
                                  "max_tokens_per_doc=8 is not supported"),
    "a lone surrogate": (dict(content=b'{"text_1": "q\\ud800", "text_2": "d"}', headers=JSON), 400,
                         "character 1 is a lone surrogate"),
    "JSON nested too deep": (dict(content=b'{"text_1": ' + b"[" * 15_000 + b"]" * 15_000 + b"}", headers=JSON), 400,
                             "not valid JSON for this API (RecursionError"),
    "a number of 5000 digits": (dict(content=b'{"text_1": "q", "text_2": "d", "priority": ' + b"9" * 5000 + b"}",
                                     headers=JSON), 400, "not valid JSON for this API (ValueError"),
    "not UTF-8": (dict(content=b'{"text_1": "q\xff", "text_2": "d"}', headers=JSON), 400, "not valid JSON"),
    "another media type": (dict(content=b"text_1=q&text_2=d", headers={"content-type": "text/plain"}), 400,
                           "expected a JSON object (Content-Type: application/json); got text/plain"),
    "a body over the limit": (dict(json={"text_1": "q", "text_2": "x" * 40_000}), 413, "at most 32768 bytes"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_bad_input_gets_a_json_error_saying_what_was_expected(client, case):
    request, status, message = ERRORS[case]
    response = client.post("/score", **request)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["code"] == status and error["type"].endswith("Error")


def test_a_rerank_for_another_model_or_with_too_many_documents_is_refused(client):
    assert client.post("/rerank", json={"model": "x", "query": "q", "documents": ["d"]}).status_code == 404
    too_many = client.post("/v2/rerank", json={"query": "q", "documents": ["d"] * 17})
    assert too_many.status_code == 400 and "at most 16 documents" in too_many.json()["error"]["message"]


def test_a_body_without_a_declared_length_is_cut_off_at_the_limit_too(client):
    chunks = (b'{"text_1": "q", "text_2": "' + b"x" * 8192 if i == 0 else b"x" * 8192 for i in range(5))
    response = client.post("/score", content=chunks, headers=JSON)  # chunked: no content-length
    assert response.status_code == 413 and "sent more" in response.json()["error"]["message"]
    assert client.get("/health").status_code == 200  # the server goes on


class Gate:
    """Holds the Scorer's predict calls until opened: requests sent meanwhile wait in the queue together."""

    def __init__(self, scorer, monkeypatch):
        self.entered, self.opened, self.calls, self.predict = threading.Event(), threading.Event(), [], scorer.predict

        def held(pairs, **kwargs):
            self.calls.append(list(pairs))
            self.entered.set()
            assert self.opened.wait(30)
            return self.predict(pairs, **kwargs)

        monkeypatch.setattr(scorer, "predict", held)

    def __enter__(self):
        return self

    def __exit__(self, *exc):  # a failed test lets the held calls go, so that the server can stop
        self.opened.set()


def _post(url, path, body):
    return httpx.post(url + path, json=body, timeout=60)


def _wait_queued(app, n):
    deadline = time.monotonic() + 10
    while app.state.batcher.queued < n:
        assert time.monotonic() < deadline, f"{app.state.batcher.queued} requests queued, waiting for {n}"
        time.sleep(0.005)


def test_a_full_queue_gets_503_with_retry_after_and_the_queued_requests_are_still_served(tiny_dir, monkeypatch):
    scorer = Scorer(tiny_dir, device="cpu")
    gate, app = Gate(scorer, monkeypatch), create_app(scorer, "tiny", Limits(max_queue=1))
    with ServerThread(app) as server, ThreadPoolExecutor(2) as pool, gate:
        running = pool.submit(_post, server.url, "/score", {"text_1": "q", "text_2": "running"})
        assert gate.entered.wait(10)
        queued = pool.submit(_post, server.url, "/rerank", {"query": "q", "documents": ["queued", "too"]})
        _wait_queued(app, 1)
        refused = _post(server.url, "/score", {"text_1": "q", "text_2": "refused"})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "busy" in refused.json()["error"]["message"]
        gate.opened.set()
        assert running.result().status_code == 200 and queued.result().status_code == 200
        assert _post(server.url, "/score", {"text_1": "q", "text_2": "later"}).status_code == 200


def test_a_request_whose_client_disconnects_while_queued_is_never_scored(tiny_dir, monkeypatch):
    scorer = Scorer(tiny_dir, device="cpu")
    gate, app = Gate(scorer, monkeypatch), create_app(scorer, "tiny")
    with ServerThread(app) as server, ThreadPoolExecutor(1) as pool, gate:
        held = pool.submit(_post, server.url, "/score", {"text_1": "q", "text_2": "held"})
        assert gate.entered.wait(10)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/score", json={"text_1": "q", "text_2": "gone"}, timeout=0.5)
        deadline = time.monotonic() + 10
        while app.state.batcher.queued:  # the server saw the client go and gave its request up
            assert time.monotonic() < deadline
            time.sleep(0.005)
        gate.opened.set()
        assert held.result().status_code == 200
        assert _post(server.url, "/score", {"text_1": "q", "text_2": "after"}).status_code == 200
    assert [pairs for pairs in gate.calls] == [[("q", "held")], [("q", "after")]]


def test_queued_requests_with_the_same_options_share_one_predict_call_and_each_gets_its_own_scores(
        tiny_dir, monkeypatch):
    scorer = Scorer(tiny_dir, device="cpu")
    gate, app = Gate(scorer, monkeypatch), create_app(scorer, "tiny")
    bodies = [("/score", {"text_1": "q", "text_2": DOCS[:4]}), ("/score", {"text_1": DOCS[:3], "text_2": DOCS[3:6]}),
              ("/rerank", {"query": "rivers", "documents": DOCS}), ("/v1/score", {"data_1": "x", "data_2": "y"}),
              ("/score", {"text_1": "q", "text_2": DOCS[:2], "use_activation": False})]
    with ServerThread(app) as server, ThreadPoolExecutor(len(bodies) + 1) as pool, gate:
        first = pool.submit(_post, server.url, "/score", {"text_1": "hold", "text_2": "the engine"})
        assert gate.entered.wait(10)
        futures = [pool.submit(_post, server.url, path, body) for path, body in bodies]
        _wait_queued(app, len(bodies))
        gate.opened.set()
        responses = [f.result() for f in futures]
        assert first.result().status_code == 200
    sizes = [4, 3, len(DOCS), 1]
    assert len(gate.calls) == 3 and len(gate.calls[0]) == 1  # the held request, then one call per set of options
    assert sorted(map(len, gate.calls[1:])) == sorted([sum(sizes), 2])
    merged = next(call for call in gate.calls[1:] if len(call) == sum(sizes))
    for (path, body), response in zip(bodies, responses):
        if path == "/rerank":
            pairs = [(body["query"], d) for d in body["documents"]]
            got = np.zeros(len(pairs), dtype=np.float32)
            for r in response.json()["results"]:
                got[r["index"]] = r["relevance_score"]
        else:
            a, b = (body.get("text_1", body.get("data_1")), body.get("text_2", body.get("data_2")))
            a, b = ([a] if isinstance(a, str) else a), ([b] if isinstance(b, str) else b)
            pairs, got = list(zip(a * len(b) if len(a) == 1 else a, b)), scores_of(response)
        raw = body.get("use_activation") is False
        expected = gate.predict(pairs, activation_fn=torch.nn.Identity() if raw else None)
        print(f"{path} {len(pairs)} pairs: max |served - alone| = {np.abs(got - expected).max():.1e}")
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)  # batchmates move the last bits only
        if not raw:  # the request's pairs lie together, in order, in the merged call
            assert any(merged[i : i + len(pairs)] == pairs for i in range(len(merged)))


def test_a_decoder_reranker_shares_the_querys_prefix_and_serves_predicts_scores(tmp_path_factory):
    from xenc_lab.zoo.decoders import build_decoder

    scorer = Scorer(build_decoder("qwen3-reranker", tmp_path_factory.mktemp("decoder")), device="cpu")
    docs = [f"passage {i} about rivers and mountains" for i in range(8)]
    assert scorer.tokenizer.local_files
    with ServerThread(create_app(scorer, "qwen3")) as server:
        assert not scorer.tokenizer.local_files  # a served text is never looked up as a file
        response = _post(server.url, "/rerank", {"query": "where do rivers start", "documents": docs})
        counts = (scorer.token_counts.total, scorer.token_counts.computed)  # the request's own predict call
        nn = _post(server.url, "/score", {"queries": ["a", "b"], "documents": ["c", "d"]})
    assert response.status_code == 200, response.text
    got = {r["index"]: r["relevance_score"] for r in response.json()["results"]}
    expected = scorer.predict([("where do rivers start", d) for d in docs])
    assert [got[i] for i in range(len(docs))] == expected.tolist()
    assert response.json()["usage"]["prompt_tokens"] == counts[0] and counts[1] < counts[0] / 2  # prefix run once
    assert np.array_equal(scores_of(nn), scorer.predict([("a", "c"), ("b", "d")]))


def test_a_multi_label_model_is_refused_at_start(scorer3):
    with pytest.raises(ValueError, match="one-label model"):
        create_app(scorer3)


def test_serve_command_binds_loopback_by_default_and_warns_on_any_other_address_without_a_key(
        tiny_dir, monkeypatch, capsys):
    from xenc_lab.cli import main
    from xenc_lab.serve.server import Server

    seen, served_logs = [], logging.getLogger("xenc_lab.serve")
    monkeypatch.setattr(Server, "run", lambda self: seen.append(self.config))
    monkeypatch.delenv("XENC_LAB_API_KEY", raising=False)
    monkeypatch.setattr(served_logs, "handlers", [])  # the command's log handler leaves with the test
    monkeypatch.setattr(served_logs, "level", served_logs.level)
    assert main(["serve", str(tiny_dir), "--device", "cpu", "--max-queue", "3"]) == 0
    assert seen[-1].host == "127.0.0.1" and seen[-1].port == 8000 and "warning" not in capsys.readouterr().out
    assert main(["serve", str(tiny_dir), "--device", "cpu", "--host", "0.0.0.0", "--port", "9001"]) == 0
    assert seen[-1].host == "0.0.0.0" and "no authentication" in capsys.readouterr().out
    assert main(["serve", str(tiny_dir), "--device", "cpu", "--host", "0.0.0.0", "--api-key", "k",
                 "--limit-concurrency", "7", "--timeout-keep-alive", "2.5"]) == 0
    assert "warning" not in capsys.readouterr().out
    assert seen[-1].limit_concurrency == 7 and seen[-1].timeout_keep_alive == 2.5
    with pytest.raises(SystemExit):
        main(["serve", str(tiny_dir), "--body-timeout", "0"])


def test_serve_command_passes_quantization_to_the_scorer_and_refuses_a_bad_one(tiny_dir, monkeypatch, capsys):
    from xenc_lab.cli import main
    from xenc_lab.serve import app as app_module
    from xenc_lab.serve.server import Server

    served, served_logs = [], logging.getLogger("xenc_lab.serve")
    monkeypatch.setattr(Server, "run", lambda self: None)
    monkeypatch.setattr(app_module, "create_app", lambda scorer, *a, **k: served.append(scorer) or create_app(
        scorer, *a, **k))
    monkeypatch.setattr(served_logs, "handlers", [])
    monkeypatch.setattr(served_logs, "level", served_logs.level)
    assert main(["serve", str(tiny_dir), "--device", "cpu", "--quantization", "int8"]) == 0
    assert served[-1].config.quantization == "int8" and "quantization='int8'" in capsys.readouterr().out
    assert main(["serve", str(tiny_dir), "--device", "cpu"]) == 0
    assert served[-1].config.quantization is None
    with pytest.raises(SystemExit) as exit_:
        main(["serve", str(tiny_dir), "--quantization", "fp8"])
    assert exit_.value.code == 2 and "--quantization: invalid choice: 'fp8'" in capsys.readouterr().err


@pytest.mark.slow
def test_importing_xenc_lab_does_not_import_the_web_stack():
    import subprocess
    import sys

    code = ("import sys, xenc_lab, xenc_lab.cli; "
            "print([m for m in sys.modules if m.split('.')[0] in ('fastapi', 'uvicorn', 'starlette')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow
def test_no_request_generated_from_the_openapi_schema_gets_a_server_error(served):
    """100 requests drawn from every operation's schema, valid and invalid (wrong types, missing fields, odd media
    types, edge values), by schemathesis: each is answered 2xx or 4xx."""
    schema = schemathesis.openapi.from_url(served.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 8
    cases = st.one_of([op.as_strategy(generation_mode=mode) for op in operations for mode in schemathesis.GenerationMode])
    seen = []

    @given(case=cases)
    @settings(max_examples=100, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def answered_without_a_server_error(case):
        response = case.call(timeout=30)
        seen.append(response.status_code)
        assert response.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {response.text}"

    answered_without_a_server_error()
    print(f"{len(seen)} requests: " + ", ".join(f"{code}: {seen.count(code)}" for code in sorted(set(seen))))
    assert 200 in seen and 400 in seen


def test_a_served_decoder_never_asks_the_file_system_about_a_text(tmp_path, monkeypatch):
    import xenc_lab.decoder.chat as chat

    looked = []
    monkeypatch.setattr(chat.os.path, "isfile", lambda p: looked.append(p) or True)
    assert chat.text_kind("/etc/passwd.png") == "image" and looked == ["/etc/passwd.png"]  # as sentence-transformers
    looked.clear()
    assert chat.text_kind("/etc/passwd.png", local_files=False) == "text" and looked == []
