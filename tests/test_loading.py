"""Loading: only safetensors, only supported architectures, every tensor accounted for, clear errors otherwise."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from xenc_lab import Scorer
from xenc_lab.models import ARCHITECTURES


@pytest.fixture
def copy_of(tmp_path, tiny_dir):
    target = tmp_path / "model"
    shutil.copytree(tiny_dir, target)
    return target


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_a_checkpoint_with_only_pytorch_model_bin_is_refused_for_want_of_safetensors(copy_of):
    state = load_file(copy_of / "model.safetensors")
    (copy_of / "model.safetensors").unlink()
    torch.save(state, copy_of / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors") as err:
        Scorer(copy_of, device="cpu")
    assert "pytorch_model.bin" in str(err.value)


def test_an_unsupported_architecture_is_refused_listing_the_supported_ones(copy_of):
    _edit_config(copy_of, architectures=["GPT2ForSequenceClassification"])
    with pytest.raises(ValueError) as err:
        Scorer(copy_of, device="cpu")
    message = str(err.value)
    assert "GPT2ForSequenceClassification" in message
    assert ARCHITECTURES and all(name in message for name in ARCHITECTURES), message


def test_a_config_naming_no_architecture_is_refused(copy_of):
    _edit_config(copy_of, architectures=None)
    with pytest.raises(ValueError, match="architecture"):
        Scorer(copy_of, device="cpu")


def test_a_nonexistent_local_path_is_refused_with_valueerror(tmp_path):
    with pytest.raises(ValueError, match="no-such-dir"):
        Scorer(tmp_path / "no-such-dir", device="cpu")


def test_an_unknown_hub_id_is_refused_with_valueerror_when_offline(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ValueError, match="xenc-lab-tests/no-such-model"):
        Scorer("xenc-lab-tests/no-such-model", device="cpu")


def test_a_file_instead_of_a_directory_is_refused_with_valueerror(tiny_dir):
    with pytest.raises(ValueError, match="model.safetensors"):
        Scorer(tiny_dir / "model.safetensors", device="cpu")


def test_a_non_path_model_argument_is_refused_with_typeerror():
    with pytest.raises(TypeError, match="model_name_or_path"):
        Scorer(42, device="cpu")


@pytest.mark.parametrize("dropped", ["classifier.weight", "bert.encoder.layer.1.attention.self.key.bias"])
def test_a_checkpoint_missing_a_tensor_is_refused_naming_it(copy_of, dropped):
    state = load_file(copy_of / "model.safetensors")
    assert dropped in state
    del state[dropped]
    save_file(state, copy_of / "model.safetensors")
    with pytest.raises(ValueError, match="missing") as err:
        Scorer(copy_of, device="cpu")
    assert dropped in str(err.value)


def test_a_checkpoint_tensor_the_model_does_not_use_is_reported_and_scores_unchanged(copy_of, caplog):
    before = Scorer(copy_of, device="cpu").predict([("a", "b"), ("hello", "world")])
    state = load_file(copy_of / "model.safetensors")
    state["bert.stray.weight"] = torch.zeros(2)
    save_file(state, copy_of / "model.safetensors")
    with caplog.at_level("WARNING", logger="xenc_lab.loader"):
        after = Scorer(copy_of, device="cpu").predict([("a", "b"), ("hello", "world")])
    assert "bert.stray.weight" in caplog.text  # transformers ignores such tensors too; we say so
    np.testing.assert_allclose(before, after, atol=1e-6, rtol=0)


def test_a_checkpoint_tensor_of_the_wrong_shape_is_refused_naming_it(copy_of):
    state = load_file(copy_of / "model.safetensors")
    state["classifier.weight"] = torch.zeros(2, 32)
    save_file(state, copy_of / "model.safetensors")
    with pytest.raises(ValueError, match=r"classifier\.weight"):
        Scorer(copy_of, device="cpu")


def test_old_position_id_buffers_in_a_checkpoint_are_tolerated(copy_of, scorer):
    state = load_file(copy_of / "model.safetensors")
    state["bert.embeddings.position_ids"] = torch.arange(64)[None]
    save_file(state, copy_of / "model.safetensors")
    pairs = [("q", "d"), ("hello", "world")]
    np.testing.assert_allclose(Scorer(copy_of, device="cpu").predict(pairs), scorer.predict(pairs), rtol=0, atol=1e-6)


@pytest.mark.parametrize("where", ["tokenizer_config.json", "sentence_bert_config.json"])
def test_a_saved_max_length_of_a_crossencoder_save_truncates_like_the_oracle(tmp_path, tiny_dir, where):
    from sentence_transformers import CrossEncoder

    saved = tmp_path / "saved"
    CrossEncoder(str(tiny_dir), device="cpu", max_length=12).save_pretrained(str(saved))  # -> tokenizer_config.json
    want = 12
    if where == "sentence_bert_config.json":  # as older sentence-transformers saves wrote it
        config = json.loads((saved / "sentence_bert_config.json").read_text())
        config["max_seq_length"] = want = 10
        (saved / "sentence_bert_config.json").write_text(json.dumps(config))
    ours, theirs = Scorer(saved, device="cpu"), CrossEncoder(str(saved), device="cpu")
    assert ours.max_length == theirs.max_seq_length == want
    pairs = [("a long query " * 5, "and an even longer document " * 5), ("q", "d")]
    np.testing.assert_allclose(ours.predict(pairs), theirs.predict(pairs), rtol=0, atol=1e-5)


def test_sentence_bert_config_outside_a_crossencoder_save_does_not_change_max_length(copy_of):
    from sentence_transformers import CrossEncoder

    (copy_of / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8}))
    ours, theirs = Scorer(copy_of, device="cpu"), CrossEncoder(str(copy_of), device="cpu")
    pairs = [("q", "d " * 100)]
    assert ours.max_length == theirs.max_seq_length
    np.testing.assert_allclose(ours.predict(pairs), theirs.predict(pairs), rtol=0, atol=1e-5)


def test_a_hub_id_is_found_in_the_huggingface_hub_cache_offline(tiny_dir, tmp_path, monkeypatch):
    """A model downloaded once (laid out as huggingface_hub caches it) loads by its hub id with no network."""
    import shutil

    import huggingface_hub.constants

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-cross-encoder"
    shutil.copytree(tiny_dir, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    by_id = Scorer("acme/tiny-cross-encoder", device="cpu")
    assert by_id.path == repo / "snapshots" / revision
    np.testing.assert_allclose(by_id.predict([("a", "b")]), Scorer(tiny_dir, device="cpu").predict([("a", "b")]), atol=1e-6)


def test_loading_onto_the_cpu_builds_the_native_kernels_before_the_first_predict(tiny_dir, monkeypatch):
    from xenc_lab import kernels

    builds = []
    monkeypatch.setattr(kernels, "_answers", {})  # as in a fresh process
    monkeypatch.setattr(kernels, "_build", lambda: builds.append(1) or False)
    Scorer(tiny_dir, device="cpu")
    assert builds == [1]  # built (or found) while loading, once; predict() then finds the answer cached
    Scorer(tiny_dir, device="cpu")
    assert builds == [1]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("units", [False, True, None])
def test_16_bit_on_a_cpu_without_its_units_warns_that_float32_is_as_fast_or_faster(tiny_dir, monkeypatch, recwarn, dtype, units):
    import xenc_lab.scorer

    monkeypatch.setattr(xenc_lab.scorer, "native_half_units", lambda asked: units if asked == dtype else True)
    scorer = Scorer(tiny_dir, device="cpu", dtype=dtype)
    slow = [w for w in recwarn if "than dtype='float32'" in str(w.message)]
    assert len(slow) == (units is False)  # not where the units are there, nor where the flags cannot be read
    if slow:
        assert dtype in str(slow[0].message) and slow[0].filename == __file__  # points at the caller's line
    scorer.predict([("a query", "a passage")])  # and it still scores


@pytest.mark.parametrize(
    ("machine", "flags", "expected"),
    [
        ("x86_64", {"avx2", "fma"}, {"bfloat16": False, "float16": False}),
        ("x86_64", {"avx512f", "avx512_bf16"}, {"bfloat16": True, "float16": False}),
        ("x86_64", {"amx_bf16", "amx_tile", "avx512_fp16"}, {"bfloat16": True, "float16": True}),
        ("aarch64", {"fp", "asimd", "bf16"}, {"bfloat16": None, "float16": None}),
        ("x86_64", set(), {"bfloat16": None, "float16": None}),  # no /proc/cpuinfo
    ],
)
def test_native_half_units_are_read_from_the_cpu_flags(monkeypatch, machine, flags, expected):
    from xenc_lab import cpuinfo

    info = cpuinfo.CpuInfo("", "a CPU", frozenset(flags))
    monkeypatch.setattr(cpuinfo, "cpu_info", lambda: info)
    monkeypatch.setattr(cpuinfo.platform, "machine", lambda: machine)
    assert {dtype: cpuinfo.native_half_units(dtype) for dtype in expected} == expected
