"""Loading: only safetensors, only supported architectures, every tensor accounted for, clear errors otherwise."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from xenc_lab import Scorer
from xenc_lab.cpu import native
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
    builds = []
    monkeypatch.setattr(native, "_answers", {})  # as in a fresh process
    monkeypatch.setattr(native, "_build", lambda: builds.append(1) or False)
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
    from xenc_lab.cpu import info as cpuinfo

    info = cpuinfo.CpuInfo("", "a CPU", frozenset(flags))
    monkeypatch.setattr(cpuinfo, "cpu_info", lambda: info)
    monkeypatch.setattr(cpuinfo.platform, "machine", lambda: machine)
    assert {dtype: cpuinfo.native_half_units(dtype) for dtype in expected} == expected


# -- which files, and a CrossEncoder save's own settings, as CrossEncoder reads them -----------------------------------
PAIRS = [("how tall is everest", "Everest is 8,849 m high."), ("q", "d"), ("a query about rivers", "the river flows " * 40)]


def _scores_alike(path, **scorer_kwargs):
    """Our scores and CrossEncoder's on ``path``: equal, and returned."""
    from sentence_transformers import CrossEncoder

    ours = Scorer(path, device="cpu", **scorer_kwargs).predict(PAIRS)
    np.testing.assert_allclose(ours, CrossEncoder(str(path), device="cpu").predict(PAIRS), rtol=0, atol=1e-5)
    return ours


@pytest.fixture
def save(tmp_path, tiny_dir):
    """A CrossEncoder save of the tiny model, as sentence-transformers writes it."""
    from sentence_transformers import CrossEncoder

    target = tmp_path / "save"
    CrossEncoder(str(tiny_dir), device="cpu").save_pretrained(str(target))
    return target


def _edit_json(path, **changes):
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.update(changes)
    path.write_text(json.dumps(data))


def test_other_safetensors_files_beside_the_model_s_are_never_read(copy_of, scorer):
    want = scorer.predict(PAIRS)
    state = load_file(copy_of / "model.safetensors")
    save_file({k: v * 3 if v.is_floating_point() else v for k, v in state.items()}, copy_of / "old_model.safetensors")
    save_file({k: v * 5 if v.is_floating_point() else v for k, v in state.items()}, copy_of / "model_1.safetensors")
    np.testing.assert_array_equal(Scorer(copy_of, device="cpu").predict(PAIRS), want)
    np.testing.assert_allclose(_scores_alike(copy_of), want, rtol=0, atol=1e-6)


def test_sharded_weights_are_read_from_the_shards_the_index_names(copy_of, scorer):
    state = load_file(copy_of / "model.safetensors")
    (copy_of / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, copy_of / file)
    save_file({k: v * 3 for k, v in state.items() if v.is_floating_point()}, copy_of / "stray.safetensors")
    index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (copy_of / "model.safetensors.index.json").write_text(json.dumps(index))
    np.testing.assert_allclose(_scores_alike(copy_of), scorer.predict(PAIRS), rtol=0, atol=1e-6)


def test_weights_under_another_name_alone_are_refused_naming_what_was_found(copy_of):
    (copy_of / "model.safetensors").rename(copy_of / "weights.safetensors")
    with pytest.raises(ValueError, match=r"no model.safetensors .* \(found weights.safetensors: name the model's weights"):
        Scorer(copy_of, device="cpu")


def test_a_saved_processing_kwargs_max_length_truncates_like_the_oracle(tmp_path, tiny_dir):
    from sentence_transformers import CrossEncoder
    from sentence_transformers.base.modules import Transformer

    module = Transformer(str(tiny_dir), transformer_task="sequence-classification",
                         processing_kwargs={"text": {"max_length": 16}})
    CrossEncoder(modules=[module], device="cpu").save(str(tmp_path / "save"))  # sentence-transformers writes the key
    assert "processing_kwargs" in json.loads((tmp_path / "save" / "sentence_bert_config.json").read_text())
    got = _scores_alike(tmp_path / "save")
    assert Scorer(tmp_path / "save", device="cpu").max_length == 16
    assert abs(got[2] - Scorer(tiny_dir, device="cpu").predict(PAIRS)[2]) > 1e-3, "the long pair must be cut"
    with pytest.raises(ValueError, match=r"sentence_bert_config.json's processing_kwargs: xenc_lab takes"):
        _edit_json(tmp_path / "save" / "sentence_bert_config.json", processing_kwargs={"text": {"truncation": False}})
        Scorer(tmp_path / "save", device="cpu")


@pytest.mark.parametrize("key", ["processor_kwargs", "tokenizer_args"])
def test_a_saved_tokenizer_argument_sets_max_length_like_the_oracle(save, key):
    _edit_json(save / "sentence_bert_config.json", **{key: {"model_max_length": 16, "trust_remote_code": True}})
    _scores_alike(save)
    assert Scorer(save, device="cpu").max_length == 16


def test_the_module_config_is_read_under_its_legacy_names_like_the_oracle(save):
    (save / "sentence_bert_config.json").rename(save / "sentence_roberta_config.json")
    _edit_json(save / "sentence_roberta_config.json", max_seq_length=16)
    _scores_alike(save)
    assert Scorer(save, device="cpu").max_length == 16


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["subfolder", "subfolder-and-root", "dot-slash"])
def test_a_transformer_in_a_subfolder_of_the_save_loads_like_the_oracle(save, scorer, layout):
    modules = json.loads((save / "modules.json").read_text())
    if layout == "dot-slash":
        modules[0]["path"] = "./"
    else:
        sub = save / "0_Transformer"
        sub.mkdir()
        for file in save.iterdir():
            if file.name not in ("modules.json", "config_sentence_transformers.json", "README.md", "0_Transformer"):
                (shutil.copy if layout == "subfolder-and-root" else shutil.move)(str(file), str(sub / file.name))
        modules[0]["path"] = "0_Transformer"
    (save / "modules.json").write_text(json.dumps(modules))
    np.testing.assert_allclose(_scores_alike(save), scorer.predict(PAIRS), rtol=0, atol=1e-6)


@pytest.mark.parametrize("module_type, path, message", [
    ("custom_code.Transformer", "", "names the module class 'custom_code.Transformer', which is not sentence-transformers'"),
    ("sentence_transformers.base.modules.transformer.Transformer", "../elsewhere", "not a folder inside the save"),
])
def test_a_save_whose_module_is_not_sentence_transformers_own_in_the_save_is_refused(save, module_type, path, message):
    (save.parent / "elsewhere").mkdir()
    (save / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": path, "type": module_type}]))
    with pytest.raises(ValueError, match=message):
        Scorer(save, device="cpu")


def test_a_default_prompt_name_missing_from_the_prompts_is_refused_like_the_oracle(save):
    from sentence_transformers import CrossEncoder

    _edit_json(save / "config_sentence_transformers.json", prompts={"query": "q: "}, default_prompt_name="missing")
    with pytest.raises(ValueError, match="missing"):
        CrossEncoder(str(save), device="cpu")
    with pytest.raises(ValueError, match=r"default_prompt_name 'missing' is not one of its prompts \['query'\]"):
        Scorer(save, device="cpu")


def test_a_saved_max_length_the_positions_cannot_embed_is_refused_naming_where_it_came_from(save):
    _edit_json(save / "sentence_bert_config.json", max_seq_length=100)
    with pytest.raises(ValueError, match=r"max_length=100 \(from sentence_bert_config.json's max_seq_length\) exceeds"):
        Scorer(save, device="cpu")


def test_a_roberta_tokenizer_without_model_max_length_is_capped_at_the_positions_it_can_embed(tmp_path, caplog):
    from sentence_transformers import CrossEncoder

    from xenc_lab.zoo.encoders import build_model

    path = build_model("roberta", tmp_path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("model_max_length", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    positions = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    scorer = Scorer(path, device="cpu")
    assert scorer.max_length == positions - 2 and "pairs are cut at" in caplog.text  # padding_idx 1, plus one
    oracle = CrossEncoder(str(path), device="cpu")
    assert oracle.max_seq_length == positions  # it fails on pairs longer than the table embeds
    np.testing.assert_allclose(scorer.predict(PAIRS[:2]), oracle.predict(PAIRS[:2]), rtol=0, atol=1e-5)


def test_online_the_hub_is_asked_before_the_cache_and_the_cache_answers_when_it_cannot(monkeypatch, tiny_dir):
    import huggingface_hub
    import huggingface_hub.constants

    from xenc_lab.loader import resolve

    calls = []

    def snapshot_download(repo_id, allow_patterns, local_files_only):
        calls.append(local_files_only)
        if not local_files_only:
            raise ConnectionError("no network")
        return str(tiny_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert resolve("acme/model") == tiny_dir and calls == [False, True]
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    calls.clear()
    assert resolve("acme/model") == tiny_dir and calls == [True]
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: (_ for _ in ()).throw(OSError("gone")))
    with pytest.raises(ValueError, match=r"'acme/model' is neither .* \(OSError: gone\)"):
        resolve("acme/model")
