"""Prompts: an explicit prompt, a named one, or a CrossEncoder save's default is prepended to text_1, as there."""
from __future__ import annotations

import numpy as np
import pytest

from xenc_lab import Scorer

PAIRS = [("how tall is everest", "Everest is 8,849 m high."), ("q", "d"), ("hello world", "")]
PROMPTS = {"query": "query: ", "question": "Answer the question: "}


@pytest.fixture(scope="module")
def prompted(tmp_path_factory, tiny_dir):
    from sentence_transformers import CrossEncoder

    path = tmp_path_factory.mktemp("prompted") / "model"
    CrossEncoder(str(tiny_dir), device="cpu", prompts=PROMPTS, default_prompt_name="query").save_pretrained(str(path))
    return Scorer(path, device="cpu"), CrossEncoder(str(path), device="cpu")


def test_a_saves_default_prompt_is_prepended_like_the_oracle(prompted, scorer):
    ours, theirs = prompted
    got = ours.predict(PAIRS)
    np.testing.assert_allclose(got, theirs.predict(PAIRS), rtol=0, atol=1e-5)
    explicit = scorer.predict([("query: " + a, b) for a, b in PAIRS])
    np.testing.assert_allclose(got, explicit, rtol=0, atol=1e-6)
    assert not np.allclose(got, scorer.predict(PAIRS), atol=1e-4), "the prompt must change the scores"


@pytest.mark.parametrize("kwargs", [{"prompt_name": "question"}, {"prompt": "Zzz "}], ids=["named", "explicit"])
def test_a_named_or_explicit_prompt_overrides_the_default_like_the_oracle(prompted, kwargs):
    ours, theirs = prompted
    np.testing.assert_allclose(ours.predict(PAIRS, **kwargs), theirs.predict(PAIRS, **kwargs), rtol=0, atol=1e-5)
    ranked, want = ours.rank("q", ["a", "b", "c d"], **kwargs), theirs.rank("q", ["a", "b", "c d"], **kwargs)
    assert [r["corpus_id"] for r in ranked] == [r["corpus_id"] for r in want]


def test_an_unknown_prompt_name_is_refused_with_valueerror(prompted):
    ours, _ = prompted
    with pytest.raises(ValueError, match="nope"):
        ours.predict(PAIRS, prompt_name="nope")
