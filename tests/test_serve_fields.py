"""Every vLLM request field of the score and rerank APIs, over real HTTP on loopback: honoured as vLLM honours it
(``truncation_side`` left and right against sentence-transformers with its tokenizer cutting from that side,
``request_id``, ``cache_salt``, the default values of the rest) or refused with a 400 that names it
(``label_token_ids``, ``normalize``, ``add_special_tokens: false``, a negative ``top_n``...); an unknown field is
ignored with a warning that names it, as vLLM's server does."""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.conftest import PAIRS
from tests.test_serve import Gate, _post, _wait_queued, scores_of
from xenc_lab import Scorer
from xenc_lab.serve.app import create_app
from xenc_lab.serve.server import ServerThread
from xenc_lab.serve.truncation import truncating_from

QUERY, DOCS = PAIRS[0][0], [d for _, d in PAIRS]
NN = {"text_1": [q for q, _ in PAIRS], "text_2": DOCS}


@pytest.fixture(scope="module")
def client(scorer):
    with ServerThread(create_app(scorer, "tiny")) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


REFUSED = {  # field: (value, what the message says)
    "label_token_ids": ([5, 6], "label_token_ids is not supported"),
    "label_token_ids []": ([], "label_token_ids is not supported"),
    "label_token_ids huge": ([9999999999], "label_token_ids is not supported"),
    "normalize": (True, "normalize is not supported by this server (vLLM removed it; use use_activation)"),
    "normalize false": (False, "normalize is not supported"),
    "add_special_tokens": (False, "add_special_tokens=False is not supported"),
    "truncation_side": ("middle", "truncation_side: expected 'left' or 'right'"),
    "padding": ("max_length", "padding='max_length' is not supported"),
    "priority": (1, "priority=1 is not supported"),
    "max_tokens_per_query": (4, "max_tokens_per_query=4 is not supported"),
    "max_tokens_per_doc": (8, "max_tokens_per_doc=8 is not supported"),
    "mm_processor_kwargs": ({"fps": 1}, "mm_processor_kwargs={'fps': 1} is not supported"),
    "cache_salt": ("", "cache_salt: String should have at least 1 character"),
    "chat_template": ("{{ messages }}", "chat_template is not supported"),
    "raw_scores": (True, "raw_scores is not supported"),
    "truncation_direction": ("left", "use truncation_side"),
    "apply_softmax": (True, "apply_softmax is not supported"),
}


@pytest.mark.parametrize("path", ["/score", "/rerank"])
@pytest.mark.parametrize("case", REFUSED)
def test_a_field_that_would_change_the_scores_is_refused_with_a_400_naming_it(client, path, case):
    value, message = REFUSED[case]
    body = {"text_1": QUERY, "text_2": DOCS} if path == "/score" else {"query": QUERY, "documents": DOCS}
    response = client.post(path, json={**body, case.split()[0]: value})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_a_negative_top_n_is_refused_and_zero_or_null_returns_every_document(client):
    body = {"query": QUERY, "documents": DOCS}
    refused = client.post("/rerank", json={**body, "top_n": -1})
    assert refused.status_code == 400 and "top_n: expected greater than or equal to 0" in refused.text
    for top_n in (0, None):
        assert len(client.post("/v2/rerank", json={**body, "top_n": top_n}).json()["results"]) == len(DOCS)


def test_the_fields_default_values_are_accepted_and_change_nothing(client, scorer):
    defaults = {"add_special_tokens": True, "padding": "do_not_pad", "priority": 0, "max_tokens_per_query": 0,
                "max_tokens_per_doc": 0, "mm_processor_kwargs": None, "truncation_side": None, "user": "u",
                "cache_salt": "salt", "use_activation": None}
    assert np.array_equal(scores_of(client.post("/score", json={**NN, **defaults})), scorer.predict(PAIRS))


def test_an_unknown_field_is_ignored_with_a_warning_that_names_it_as_vllm_does(client, scorer, caplog):
    with caplog.at_level(logging.WARNING, logger="xenc_lab.serve"):
        response = client.post("/score", json={**NN, "encoding_format": "float", "x-custom": {"a": [1, 2]}})
    assert np.array_equal(scores_of(response), scorer.predict(PAIRS))
    warned = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert warned == ["The following fields were present in the request but ignored: 'encoding_format', 'x-custom'"]


def test_request_id_names_the_response_and_an_x_request_id_header_wins(client):
    assert client.post("/score", json={**NN, "request_id": "abc"}).json()["id"] == "score-abc"
    headed = client.post("/rerank", json={"query": "q", "documents": ["d"], "request_id": "abc"},
                         headers={"X-Request-Id": "xyz"})
    assert headed.json()["id"] == "rerank-xyz"


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("truncate", [16, None], ids=["truncate_prompt_tokens=16", "the model's max_length"])
def test_truncation_side_cuts_as_sentence_transformers_does_with_its_tokenizer_cutting_from_that_side(
        client, scorer, tiny_dir, side, truncate):
    from sentence_transformers import CrossEncoder

    oracle = CrossEncoder(str(tiny_dir), device="cpu", max_length=truncate)
    oracle.tokenizer.truncation_side = side
    body = {**NN, "truncation_side": side, **({"truncate_prompt_tokens": truncate} if truncate else {})}
    response = client.post("/score", json=body)
    got = scores_of(response)
    with truncating_from(scorer, side):  # the Scorer itself, its tokenizer cutting from that side
        expected = scorer.predict(PAIRS, max_length=truncate)
        tokens = int(scorer.tokenizer(*zip(*PAIRS), truncate).lengths.sum())
    print(f"{side}, {truncate}: max |served - CrossEncoder| = {np.abs(got - oracle.predict(PAIRS)).max():.1e}")
    assert np.array_equal(got, expected)
    np.testing.assert_allclose(got, oracle.predict(PAIRS), rtol=1e-4, atol=1e-5)
    assert response.json()["usage"]["prompt_tokens"] == tokens
    assert scorer.tokenizer.tokenizer.truncation_side == "right"  # put back after the call


def test_left_and_right_truncation_give_other_scores_where_pairs_are_cut(client):
    """The test above could not fail if the side were ignored where no pair is cut: here every pair is."""
    body = {"text_1": "a query about rivers and their sources", "text_2": [f"{i} the river flows " * 20 for i in
                                                                            range(3)], "truncate_prompt_tokens": 16}
    left = scores_of(client.post("/score", json={**body, "truncation_side": "left"}))
    right = scores_of(client.post("/score", json={**body, "truncation_side": "right"}))
    assert not np.allclose(left, right, atol=1e-4)


def test_requests_of_other_truncation_sides_or_cache_salts_never_share_an_engine_call(tiny_dir, monkeypatch):
    scorer = Scorer(tiny_dir, device="cpu")
    gate, app = Gate(scorer, monkeypatch), create_app(scorer, "tiny")
    bodies = [{"text_1": "q", "text_2": "a", "cache_salt": "one"}, {"text_1": "q", "text_2": "b", "cache_salt": "two"},
              {"text_1": "q", "text_2": "c", "cache_salt": "one"}, {"text_1": "q", "text_2": "d",
                                                                    "truncation_side": "left"}]
    with ServerThread(app) as server, ThreadPoolExecutor(len(bodies) + 1) as pool, gate:
        first = pool.submit(_post, server.url, "/score", {"text_1": "hold", "text_2": "the engine"})
        assert gate.entered.wait(10)
        futures = [pool.submit(_post, server.url, "/score", body) for body in bodies]
        _wait_queued(app, len(bodies))
        gate.opened.set()
        assert all(f.result().status_code == 200 for f in [first, *futures])
    assert sorted(sorted(d for _, d in call) for call in gate.calls[1:]) == [["a", "c"], ["b"], ["d"]]


def test_a_decoder_reranker_cuts_its_rendered_pairs_from_the_side_asked_for(tmp_path_factory):
    from xenc_lab.zoo.decoders import build_decoder

    scorer = Scorer(build_decoder("qwen3-reranker", tmp_path_factory.mktemp("decoder")), device="cpu")
    docs = [f"passage {i} " + "about rivers and mountains " * 12 for i in range(3)]
    body = {"query": "where do rivers start", "documents": docs, "truncate_prompt_tokens": 48}
    with ServerThread(create_app(scorer, "qwen3")) as server:
        served = {side: _post(server.url, "/rerank", {**body, "truncation_side": side}).json() for side in ("left",
                                                                                                            "right")}
    for side, out in served.items():
        got = {r["index"]: r["relevance_score"] for r in out["results"]}
        with truncating_from(scorer, side):
            expected = scorer.predict([(body["query"], d) for d in docs], max_length=48)
        assert [got[i] for i in range(len(docs))] == expected.tolist()
        assert out["usage"]["prompt_tokens"] == 3 * 48
    assert served["left"]["results"] != served["right"]["results"]
