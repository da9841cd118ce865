"""A held-out pair table scored on a local Ray instance (two Scorer actors) against sentence-transformers, row by
row: real MiniLM-L6 weights on a parquet of docstring-collection pairs, and the tiny Qwen3-Reranker decoder."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from xenc_lab.ir.files import read_corpus, read_queries
from xenc_lab.ir.pydocs import bm25_run, python_docs_collection

from .conftest import model_dir, oracle
from .test_decoder_parity import oracle as decoder_oracle, raw_tolerance

ray = pytest.importorskip("ray")
from xenc_lab.distributed import score_dataset  # noqa: E402

ARCH = "minilm-l6 (real weights)"
DECODER = "qwen3-reranker"
TOLERANCE = 2e-5  # the parity suite's bound on MiniLM-L6's scores


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """30 queries x their 40 BM25 candidates from the docstring collection (1,200 pairs), as parquet, shuffled."""
    root = tmp_path_factory.mktemp("pydocs")
    paths = python_docs_collection(str(root), max_chars=400, max_queries=30)
    run = bm25_run(paths["queries"], paths["corpus"], k=40)
    queries, corpus = read_queries(paths["queries"]), read_corpus(paths["corpus"])
    frame = pd.DataFrame({"qid": run["qid"], "docno": run["docno"],
                          "query": [queries[q] for q in run["qid"]], "passage": [corpus[d] for d in run["docno"]]})
    frame = frame.sample(frac=1.0, random_state=7).reset_index(drop=True)
    frame.insert(0, "row", np.arange(len(frame)))
    frame.to_parquet(root / "held_out.parquet", index=False)
    return root / "held_out.parquet", frame


def test_a_held_out_parquet_scored_on_ray_equals_sentence_transformers_row_by_row(local_ray, held_out, recorder):
    path, frame = held_out
    out = score_dataset(str(path), model_dir(ARCH), text_1="query", text_2="passage", concurrency=2,
                        batch_size=256).to_pandas()
    np.testing.assert_array_equal(out["row"].to_numpy(), np.arange(len(frame)))  # every row once, in order
    assert (out[["qid", "docno"]].to_numpy() == frame[["qid", "docno"]].to_numpy()).all()
    theirs = oracle(ARCH).predict(list(zip(frame["query"], frame["passage"])), batch_size=64)
    delta = recorder.add(ARCH, "float32", "ray score_dataset", out["score"], theirs)
    print(f"\n{len(frame)} pairs on 2 Ray actors: max |delta| {delta.max():.2e}, spread {np.std(theirs):.3f}")
    assert np.std(theirs) > 0.05 and delta.max() < TOLERANCE


def test_a_decoder_reranker_on_ray_equals_sentence_transformers_row_by_row(local_ray, held_out, recorder):
    _, frame = held_out
    frame = frame.iloc[:300]
    out = score_dataset(frame, model_dir(DECODER), text_1="query", text_2="passage", concurrency=2, batch_size=64,
                        predict_options={"activation_fn": torch.nn.Identity()}).to_pandas()
    np.testing.assert_array_equal(out["row"].to_numpy(), frame["row"].to_numpy())
    theirs = decoder_oracle(DECODER).predict(list(zip(frame["query"], frame["passage"])), batch_size=32,
                                             activation_fn=torch.nn.Identity())
    recorder.add(DECODER, "float32", "ray score_dataset (raw)", out["score"], theirs)
    assert np.std(theirs) > 0.05
    np.testing.assert_allclose(out["score"], theirs, **raw_tolerance(DECODER))
