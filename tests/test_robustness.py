"""What researchers feed a Scorer by accident: broken checkpoints, arbitrary Python objects, iterators of a million
pairs, several threads at once, a KeyboardInterrupt. Each gets a clear error or the right scores, never a crash deep
inside torch, a silent truncation, or a Scorer left broken."""
import json
import os
import shutil
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from xenc_lab import Scorer
from xenc_lab.scorer import STREAM_BLOCK

PAIRS = [(f"query {i} about topic {i % 7}", f"document {i} " + "words " * (i % 13)) for i in range(300)]


# -- broken checkpoints -------------------------------------------------------------------------------------------
def _half(d):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _pickle_only(d):
    torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")
    os.remove(d / "model.safetensors")


def _no_tokenizer(d):
    for f in os.listdir(d):
        if f.startswith(("tokenizer", "vocab", "special_tokens")):
            os.remove(d / f)


def _wider_config(d):
    config = json.loads((d / "config.json").read_text())
    config["hidden_size"] = 48
    (d / "config.json").write_text(json.dumps(config))


def _drop_a_tensor(d):
    tensors = load_file(d / "model.safetensors")
    del tensors["bert.encoder.layer.1.output.dense.weight"]
    save_file(tensors, d / "model.safetensors")


BROKEN = {
    "truncated safetensors": (_half, r"model\.safetensors is not a readable safetensors file .*truncated"),
    "garbage safetensors": (lambda d: (d / "model.safetensors").write_bytes(b"\0" * 64),
                            r"not a readable safetensors file .*corrupt"),
    "no weights": (lambda d: os.remove(d / "model.safetensors"), "no model.safetensors .* only safetensors are loaded"),
    "pickle weights only": (_pickle_only, r"only safetensors are loaded \(found pytorch_model\.bin: convert them"),
    "no tokenizer files": (_no_tokenizer, r"has \d tokens, all special .* missing or empty"),
    "empty tokenizer.json": (lambda d: (d / "tokenizer.json").write_text(""),
                             "could not load the tokenizer .* missing, empty or corrupt"),
    "no config.json": (lambda d: os.remove(d / "config.json"), "no config.json in"),
    "corrupt config.json": (lambda d: (d / "config.json").write_text("{not json"), r"config\.json could not be read"),
    "config wider than the weights": (_wider_config, r"does not match its config\.json .*shapes differ.*"
                                                     r"word_embeddings\.weight: checkpoint \(\d+, 32\), config \(\d+, 48\)"),
    "a tensor missing": (_drop_a_tensor, r"missing tensors \['bert\.encoder\.layer\.1\.output\.dense\.weight'\]"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_checkpoint_is_refused_with_what_is_wrong_and_what_to_do(case, tiny_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_dir, folder)
    damage, message = BROKEN[case]
    damage(folder)
    with pytest.raises(ValueError, match=message):
        Scorer(folder, device="cpu")


def test_an_unreachable_hub_id_says_how_to_load_from_a_local_path(monkeypatch):
    with pytest.raises(ValueError, match="neither a local model directory nor a hub id .* pass the path of its "
                                         "directory") as error:
        Scorer("no-such-org/no-such-reranker", device="cpu")
    assert "\n" not in str(error.value)  # the hub's reason folded into one line


@pytest.mark.parametrize("kwargs, error, match", [
    ({"page_size": 0}, ValueError, "page_size must be an int >= 1"),
    ({"page_size": "16"}, TypeError, "page_size must be an int"),
    ({"max_batch_tokens": 10}, ValueError, "max_batch_tokens must be a whole number of pages"),
    ({"max_batch_tokens": -16}, ValueError, "max_batch_tokens must be an int >= 1"),
    ({"dtype": "int8"}, ValueError, "dtype must be one of"),
    ({"max_length": 0}, ValueError, "max_length must be an int >= 2 or None"),
    ({"device": "tpu"}, (ValueError, RuntimeError), "tpu"),
])
def test_bad_constructor_arguments_are_refused(tiny_dir, kwargs, error, match):
    with pytest.raises(error, match=match):
        Scorer(tiny_dir, **{"device": "cpu", **kwargs})


# -- arbitrary objects at the public boundary ----------------------------------------------------------------------
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=8),
                    st.binary(max_size=4))
objects = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                                                        st.tuples(inner, inner, inner),
                                                        st.dictionaries(st.text(max_size=3), inner, max_size=2)),
                       max_leaves=8)
CLEAR = (ValueError, TypeError)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pairs=objects)
def test_predict_of_any_object_returns_the_right_shape_or_raises_a_clear_error(scorer, pairs):
    try:
        out = scorer.predict(pairs)
    except CLEAR:
        return
    n = 1 if isinstance(pairs, (list, tuple)) and pairs and not isinstance(pairs[0], (list, tuple)) else len(pairs)
    assert np.shape(out) == (() if n == 1 and np.ndim(out) == 0 else (n,))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(query=objects, documents=objects, top_k=scalars, return_documents=scalars)
def test_rank_of_any_objects_returns_a_ranking_or_raises_a_clear_error(scorer, query, documents, top_k,
                                                                       return_documents):
    try:
        out = scorer.rank(query, documents, top_k=top_k, return_documents=return_documents)
    except CLEAR:
        return
    assert isinstance(out, list) and len(out) == min(len(documents), top_k or len(documents))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text_1=objects, text_2=objects)
def test_score_of_any_objects_returns_scores_or_raises_a_clear_error(scorer, text_1, text_2):
    try:
        out = scorer.score(text_1, text_2)
    except CLEAR:
        return
    assert isinstance(out, float) or np.ndim(out) == 1


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(options=st.dictionaries(st.sampled_from(["batch_size", "show_progress_bar", "apply_softmax", "convert_to_numpy",
                                                "convert_to_tensor", "prompt", "prompt_name", "max_length"]),
                               scalars, max_size=3))
def test_predict_options_of_any_value_work_or_raise_a_clear_error(scorer, options):
    try:
        out = scorer.predict(PAIRS[:3], **options)
    except CLEAR:
        return
    assert len(out) == 3


def test_a_nan_from_a_missing_cell_is_named_by_its_place(scorer):
    with pytest.raises(TypeError, match=r"pairs\[17\]\[1\] is float \(nan\); expected str"):
        scorer.predict([*PAIRS[:17], ("query", float("nan")), *PAIRS[17:20]])


# -- iterators ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_generator_of_pairs_scores_as_the_list_does_and_is_consumed_block_by_block(scorer, monkeypatch):
    pulled, seen_at_first_batch = [0], []
    runner = scorer.runner

    class Watch:
        def __getattr__(self, name):
            return getattr(runner, name)

        def __call__(self, *args):
            if not seen_at_first_batch:
                seen_at_first_batch.append(pulled[0])
            return runner(*args)

    def pairs():
        for i in range(STREAM_BLOCK + 500):
            pulled[0] += 1
            yield PAIRS[i % len(PAIRS)]

    monkeypatch.setattr(scorer, "runner", Watch())
    streamed = scorer.predict(pairs(), show_progress_bar=False)
    assert seen_at_first_batch[0] <= STREAM_BLOCK  # the first block ran before the rest was read
    want = scorer.predict(PAIRS)  # batched with other neighbours: equal to float noise, in order
    np.testing.assert_allclose(streamed, np.resize(want, STREAM_BLOCK + 500), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_a_bad_pair_late_in_a_generator_is_named_by_its_place_in_the_whole_input(scorer):
    def pairs():
        yield from PAIRS * (STREAM_BLOCK // len(PAIRS) + 1)
        yield ("query", None)

    n = len(PAIRS) * (STREAM_BLOCK // len(PAIRS) + 1)
    with pytest.raises(TypeError, match=rf"pairs\[{n}\]\[1\] is NoneType"):
        scorer.predict(pairs(), show_progress_bar=False)


def test_empty_inputs_keep_the_contract(scorer, scorer3):
    assert scorer.predict([]).shape == (0,) and scorer.predict(iter([])).shape == (0,)
    assert scorer3.predict(x for x in []).shape == (0, 3)
    assert scorer.rank("q", []) == [] and scorer.rank("q", iter([])) == []


# -- threads and interrupts -----------------------------------------------------------------------------------------
def _hammer(scorer, sets, rounds=3):
    """Each set scored ``rounds`` times by a thread of its own, all at once; set i at max_length 20 + i."""
    results, errors = {}, []

    def work(i):
        try:
            for _ in range(rounds):
                results.setdefault(i, []).append(scorer.predict(sets[i], max_length=20 + i))
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(sets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_threads_sharing_a_scorer_get_the_scores_of_sequential_calls(kind, scorer, tmp_path_factory):
    # A decoder without the Scorer's lock: threads take each other's KV-cache pages ("2 pages asked for, 0 free").
    if kind == "decoder":
        from xenc_lab.zoo.decoders import build_decoder

        scorer = Scorer(build_decoder("qwen3-reranker", tmp_path_factory.mktemp("qwen3")), device="cpu")
    sets = [PAIRS[i::6] for i in range(6)]
    sequential = [scorer.predict(s, max_length=20 + i) for i, s in enumerate(sets)]
    results, errors = _hammer(scorer, sets)
    assert not errors, errors
    for i, runs in results.items():
        for got in runs:
            np.testing.assert_array_equal(got, sequential[i])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_a_keyboard_interrupt_mid_run_leaves_the_scorer_usable_and_right(kind, tiny_dir, tmp_path_factory,
                                                                         monkeypatch):
    if kind == "decoder":
        from xenc_lab.zoo.decoders import build_decoder

        tiny_dir = build_decoder("qwen3-reranker", tmp_path_factory.mktemp("qwen3i"))
    scorer = Scorer(tiny_dir, device="cpu", max_batch_tokens=256)  # small batches: the third comes mid-run
    pairs = [("one query for all", d) for _, d in PAIRS[:120]]
    want = scorer.predict(pairs)
    runner, calls = scorer.runner, [0]

    class Interrupting:
        def __getattr__(self, name):
            return getattr(runner, name)

        def __call__(self, *args):
            calls[0] += 1
            if calls[0] == 3:
                raise KeyboardInterrupt
            return runner(*args)

    monkeypatch.setattr(scorer, "runner", Interrupting())
    with pytest.raises(KeyboardInterrupt):
        scorer.predict(pairs)
    monkeypatch.setattr(scorer, "runner", runner)
    if kind == "decoder":
        assert scorer.kv_cache.allocator.used == 0  # no page is left held by the interrupted run
    np.testing.assert_array_equal(scorer.predict(pairs), want)
