"""Default activation resolved in sentence-transformers' order; each case checked against CrossEncoder itself."""
from __future__ import annotations

import json
import logging
import shutil
import sys

import numpy as np
import pytest
from torch import nn

from xenc_lab.zoo.encoders import build_tiny
from xenc_lab import Scorer

from .activations import ScaledTanh

ATOL = 1e-5
PAIRS = [("how tall is everest", "Everest is 8,849 m high."), ("q", "d"), ("hello world", "")]
IDENTITY = "torch.nn.modules.linear.Identity"
TANH = "torch.nn.modules.activation.Tanh"
SOFTSIGN = "torch.nn.modules.activation.Softsign"
CUSTOM = "tests.activations.ScaledTanh"
UNTRUSTED = "tests.untrusted_activation.Boom"


@pytest.fixture(scope="module")
def st_files(tmp_path_factory, tiny_dir):
    """modules.json, sentence_bert_config.json and config_sentence_transformers.json as CrossEncoder saves them."""
    from sentence_transformers import CrossEncoder

    saved = tmp_path_factory.mktemp("st-saved") / "model"
    CrossEncoder(str(tiny_dir), device="cpu", activation_fn=nn.Tanh()).save_pretrained(str(saved))
    files = {n: (saved / n).read_text() for n in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")}
    assert json.loads(files["config_sentence_transformers.json"])["activation_fn"] == TANH
    assert json.loads(files["config_sentence_transformers.json"])["model_type"] == "CrossEncoder"
    return files


@pytest.fixture
def make_dir(tmp_path, st_files):
    """A tiny checkpoint with the given config.json keys and, optionally, sentence-transformers' own files."""

    def make(*, num_labels=1, st_activation=None, st_format=False, **config_extra):
        path = build_tiny(tmp_path / "model", num_labels=num_labels, **config_extra)
        if st_format:
            for name, text in st_files.items():
                (path / name).write_text(text)
            st_config = json.loads(st_files["config_sentence_transformers.json"])
            st_config["activation_fn"] = st_activation
            (path / "config_sentence_transformers.json").write_text(json.dumps(st_config))
        return path

    return make


def _both(path, **kwargs):
    from sentence_transformers import CrossEncoder

    ours = Scorer(path, device="cpu", **kwargs)
    theirs = CrossEncoder(str(path), device="cpu", **kwargs)
    return ours, theirs


def _assert_same_scores(ours, theirs):
    got, want = ours.predict(PAIRS), theirs.predict(PAIRS)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    return got


def _logits(path):
    return Scorer(path, device="cpu", activation_fn=nn.Identity()).predict(PAIRS)


# -- the order -------------------------------------------------------------------------------------
def test_default_activation_is_sigmoid_for_one_label_and_identity_for_more(make_dir, tmp_path):
    ours, theirs = _both(make_dir())
    assert isinstance(ours.activation_fn, nn.Sigmoid) and isinstance(theirs.activation_fn, nn.Sigmoid)
    got = _assert_same_scores(ours, theirs)
    assert ((got > 0) & (got < 1)).all()

    shutil.rmtree(tmp_path / "model")
    ours3, theirs3 = _both(make_dir(num_labels=3))
    assert isinstance(ours3.activation_fn, nn.Identity) and isinstance(theirs3.activation_fn, nn.Identity)
    _assert_same_scores(ours3, theirs3)


def test_explicit_activation_argument_wins_over_every_saved_setting(make_dir):
    path = make_dir(
        st_format=True, st_activation=IDENTITY,
        sentence_transformers={"activation_fn": IDENTITY}, sbert_ce_default_activation_function=IDENTITY,
    )
    ours, theirs = _both(path, activation_fn=nn.Tanh())
    assert isinstance(ours.activation_fn, nn.Tanh)
    got = _assert_same_scores(ours, theirs)
    np.testing.assert_allclose(got, np.tanh(_logits(path)), rtol=0, atol=1e-6)


def test_config_sentence_transformers_json_wins_over_config_json(make_dir):
    path = make_dir(
        st_format=True, st_activation=TANH,
        sentence_transformers={"activation_fn": IDENTITY}, sbert_ce_default_activation_function=SOFTSIGN,
    )
    ours, theirs = _both(path)
    assert isinstance(ours.activation_fn, nn.Tanh) and isinstance(theirs.activation_fn, nn.Tanh)
    _assert_same_scores(ours, theirs)


def test_config_json_sentence_transformers_section_wins_over_the_legacy_key(make_dir):
    path = make_dir(sentence_transformers={"activation_fn": IDENTITY}, sbert_ce_default_activation_function=TANH)
    ours, theirs = _both(path)
    assert isinstance(ours.activation_fn, nn.Identity) and isinstance(theirs.activation_fn, nn.Identity)
    got = _assert_same_scores(ours, theirs)
    np.testing.assert_allclose(got, _logits(path), rtol=0, atol=1e-6)


def test_legacy_sbert_ce_default_activation_function_key_is_used_when_nothing_newer_is_saved(make_dir):
    path = make_dir(sbert_ce_default_activation_function=TANH)
    ours, theirs = _both(path)
    assert isinstance(ours.activation_fn, nn.Tanh) and isinstance(theirs.activation_fn, nn.Tanh)
    _assert_same_scores(ours, theirs)


def test_a_legacy_key_set_to_null_falls_back_to_the_default(make_dir):
    path = make_dir(sentence_transformers={"activation_fn": None}, sbert_ce_default_activation_function=TANH)
    ours, theirs = _both(path)
    assert isinstance(ours.activation_fn, nn.Sigmoid) and isinstance(theirs.activation_fn, nn.Sigmoid)
    _assert_same_scores(ours, theirs)


# -- trust -----------------------------------------------------------------------------------------
UNTRUSTED_PLACES = {
    "config_sentence_transformers.json": {"st_format": True, "st_activation": UNTRUSTED},
    "config.json section": {"sentence_transformers": {"activation_fn": UNTRUSTED}},
    "legacy key": {"sbert_ce_default_activation_function": UNTRUSTED},
}


@pytest.mark.parametrize("place", list(UNTRUSTED_PLACES))
def test_untrusted_dotted_path_is_not_imported_and_falls_back_to_the_default_with_a_warning(make_dir, caplog, place):
    path = make_dir(**UNTRUSTED_PLACES[place])
    with caplog.at_level(logging.WARNING):
        ours = Scorer(path, device="cpu")  # importing the module would raise
    assert "tests.untrusted_activation" not in sys.modules
    assert isinstance(ours.activation_fn, nn.Sigmoid)
    warned = [r for r in caplog.records if r.name.startswith("xenc_lab") and r.levelno == logging.WARNING]
    assert any(UNTRUSTED in r.getMessage() and "trust_remote_code" in r.getMessage() for r in warned), caplog.text
    from sentence_transformers import CrossEncoder

    _assert_same_scores(ours, CrossEncoder(str(path), device="cpu"))


def test_untrusted_non_torch_stdlib_path_is_not_used_without_trust_remote_code(make_dir, caplog):
    path = make_dir(sentence_transformers={"activation_fn": "math.tanh"})
    with caplog.at_level(logging.WARNING):
        ours, theirs = _both(path)
    assert isinstance(ours.activation_fn, nn.Sigmoid) and isinstance(theirs.activation_fn, nn.Sigmoid)
    assert "math.tanh" in caplog.text
    _assert_same_scores(ours, theirs)


def test_untrusted_path_in_config_sentence_transformers_json_falls_through_to_config_json(make_dir):
    path = make_dir(st_format=True, st_activation=UNTRUSTED, sentence_transformers={"activation_fn": TANH})
    ours, theirs = _both(path)
    assert isinstance(ours.activation_fn, nn.Tanh) and isinstance(theirs.activation_fn, nn.Tanh)
    _assert_same_scores(ours, theirs)


@pytest.mark.slow
@pytest.mark.parametrize("place", ["config_sentence_transformers.json", "config.json section", "legacy key"])
def test_custom_dotted_path_is_used_with_trust_remote_code_and_ignored_without(make_dir, place):
    where = {
        "config_sentence_transformers.json": {"st_format": True, "st_activation": CUSTOM},
        "config.json section": {"sentence_transformers": {"activation_fn": CUSTOM}},
        "legacy key": {"sbert_ce_default_activation_function": CUSTOM},
    }[place]
    path = make_dir(**where)
    ours, theirs = _both(path, trust_remote_code=True)
    assert isinstance(ours.activation_fn, ScaledTanh) and type(theirs.activation_fn).__name__ == "ScaledTanh"
    got = _assert_same_scores(ours, theirs)
    np.testing.assert_allclose(got, 3 * np.tanh(_logits(path)), rtol=0, atol=1e-5)

    untrusted, untrusted_oracle = _both(path)
    assert isinstance(untrusted.activation_fn, nn.Sigmoid)
    _assert_same_scores(untrusted, untrusted_oracle)


# -- what counts as a CrossEncoder save ----------------------------------------------------------
@pytest.mark.parametrize("layout", ["no modules.json", "model_type SentenceTransformer"])
def test_config_sentence_transformers_json_counts_only_in_a_crossencoder_save(make_dir, layout):
    """CrossEncoder ignores the file without modules.json, or for another model_type (it converts those)."""
    path = make_dir(st_format=True, st_activation=IDENTITY)
    if layout == "no modules.json":
        (path / "modules.json").unlink()
    else:
        st_config = json.loads((path / "config_sentence_transformers.json").read_text())
        st_config["model_type"] = "SentenceTransformer"
        (path / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    ours, theirs = _both(path)
    assert isinstance(theirs.activation_fn, nn.Sigmoid)  # the contract
    assert type(ours.activation_fn) is type(theirs.activation_fn)
    _assert_same_scores(ours, theirs)


# -- bugs ----------------------------------------------------------------------------------------------
def test_an_explicit_but_falsy_activation_is_still_used(tiny_dir, oracle):
    from sentence_transformers import CrossEncoder

    identity = nn.Sequential()  # an empty Sequential is the identity, and has len() == 0
    theirs = CrossEncoder(str(tiny_dir), device="cpu", activation_fn=nn.Sequential())
    ours = Scorer(tiny_dir, device="cpu", activation_fn=identity)
    assert ours.activation_fn is identity
    _assert_same_scores(ours, theirs)
    per_call = Scorer(tiny_dir, device="cpu").predict(PAIRS, activation_fn=nn.Sequential())
    np.testing.assert_allclose(per_call, oracle.predict(PAIRS, activation_fn=nn.Sequential()), rtol=0, atol=ATOL)
