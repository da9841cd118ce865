"""Properties that prove xenc_lab's scores are sentence-transformers' CrossEncoder scores.

Every property runs for every architecture in conftest.MODELS, eager and (for raw logits) compiled. Tolerances: raw logits within
abs 1e-5 x (the model's logit scale, at least 1) + rel 1e-4; activated scores in [0, 1] within 1e-5, and
unbounded ones (an identity activation) as raw logits; a pair's score independent of its batch within 1e-5
(plus 1e-5 relative for unbounded scores).

Where a result is outside its tolerance, the same pairs are scored by the oracle in float64, and ours must then be no
further from that exact result than sentence-transformers' own fp32 result is (plus the tolerance). Some inputs
are ill-conditioned for the tiny random models (a near one-hot attention, say): there the oracle's own fp32 error
exceeds the tolerance, and agreeing with its rounding would prove nothing. A wrong result is far from both.

The logit scale is the std of the oracle's raw logits on a fixed probe set: fp32 rounding differences
(our GEMMs and attention are not sentence-transformers' MKL and SDPA) grow with the size of a model's
activations, and the tiny random models' logits reach tens; for the real MiniLM the scale is below 1.
"""
from __future__ import annotations

import collections
import functools
import warnings

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from . import strategies as S
from .arbitration import arbitrate, scaled_tolerance
from .conftest import ARCHS, DEVICE, exact_oracle, model_dir, oracle, scorer

IDENTITY = torch.nn.Identity()


@functools.cache
def logit_scale(arch: str) -> float:
    """Std of the oracle's raw logits on a fixed probe set of pairs."""
    pairs = [(q, d) for q in S.ODD[:8] for d in ("a short passage", " ".join(S.WORDS[:60]))]
    return float(np.std(oracle(arch).predict(pairs, activation_fn=IDENTITY)))


def logit_tolerance(arch: str) -> dict:
    return scaled_tolerance(logit_scale(arch))


def bounded(arch: str, softmax: bool = False) -> bool:
    """Whether the scores lie in [0, 1] (sigmoid, softmax); an identity activation leaves logits."""
    return softmax or isinstance(scorer(arch).activation_fn, (torch.nn.Sigmoid, torch.nn.Softmax))


def share(fraction: float) -> settings:
    """A share of the profile's examples, for the properties that cost the most per example."""
    return settings(max_examples=max(10, int(settings.default.max_examples * fraction)))


def _st_token_ids(ce, pairs):
    features = ce.preprocess([list(p) for p in pairs])
    mask = features["attention_mask"].bool()
    ids = [row[m].tolist() for row, m in zip(features["input_ids"], mask)]
    types = None
    if "token_type_ids" in features:
        types = [row[m].tolist() for row, m in zip(features["token_type_ids"], mask)]
    return ids, types


def assert_as_exact_as_the_oracle(arch, pairs, ours, theirs, tolerance, recorder, max_length=None, exact=None,
                                  **predict_kwargs):
    """The suite's rule (arbitration.py), the float64 result from ``exact`` (default: the architecture's float64
    oracle at ``max_length``)."""
    arbitrate(arch, ours, theirs, tolerance, recorder,
              lambda: (exact if exact is not None else exact_oracle(arch, max_length)).predict(pairs, **predict_kwargs))


@pytest.mark.parametrize("arch", ARCHS)
@given(pairs=S.pairs)
def test_raw_logits_equal_crossencoder(arch, pairs, recorder):
    ours = scorer(arch).predict(pairs, activation_fn=IDENTITY)
    theirs = oracle(arch).predict(pairs, activation_fn=IDENTITY)
    recorder.add(arch, "float32", "raw logits", ours, theirs)
    assert_as_exact_as_the_oracle(arch, pairs, ours, theirs, logit_tolerance(arch), recorder, activation_fn=IDENTITY)


@pytest.mark.parametrize("arch", ARCHS)
@share(0.5)
@given(pairs=S.pairs, softmax=st.booleans())
def test_activated_scores_equal_crossencoder(arch, pairs, softmax, recorder):
    ours = scorer(arch).predict(pairs, apply_softmax=softmax)
    theirs = oracle(arch).predict(pairs, apply_softmax=softmax)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    recorder.add(arch, "float32", "activated scores", ours, theirs)
    tolerance = {"atol": 1e-5, "rtol": 0} if bounded(arch, softmax) else logit_tolerance(arch)
    assert_as_exact_as_the_oracle(arch, pairs, ours, theirs, tolerance, recorder, apply_softmax=softmax)


@pytest.mark.parametrize("arch", ARCHS)
@given(pairs=S.pairs)
def test_token_ids_equal_sentence_transformers_preprocess(arch, pairs):
    enc = scorer(arch).tokenizer([p[0] for p in pairs], [p[1] for p in pairs])
    ids, types = _st_token_ids(oracle(arch), pairs)
    assert [enc.pair(i) for i in range(len(pairs))] == ids
    if types is None:
        assert enc.type_ids is None
    else:
        assert [enc.type_ids[enc.offsets[i] : enc.offsets[i + 1]].tolist() for i in range(len(pairs))] == types


# An ill-conditioned input found at random: both fp32 results off by 2.5e-5 or more from float64 (atol 2.2e-5).
ILL_CONDITIONED = [
    (
        "climate or most than passage its protein all election museum about" + " the" * 51,
        "could battery been that years river to can for over only do over which and" + " the" * 44,
    )
]


@pytest.mark.parametrize("arch", ARCHS)
@share(0.3)
@given(pairs=S.pairs, max_length=st.sampled_from([8, 23, 64]))
@example(pairs=ILL_CONDITIONED, max_length=64)
def test_truncation_at_small_max_length_equals_crossencoder(arch, max_length, pairs, recorder):
    ours_scorer = scorer(arch, max_length=max_length)
    enc = ours_scorer.tokenizer([p[0] for p in pairs], [p[1] for p in pairs])
    ids, _ = _st_token_ids(oracle(arch, max_length), pairs)
    assert [enc.pair(i) for i in range(len(pairs))] == ids
    assert max(len(i) for i in ids) <= max_length
    ours = ours_scorer.predict(pairs, activation_fn=IDENTITY)
    theirs = oracle(arch, max_length).predict(pairs, activation_fn=IDENTITY)
    recorder.add(arch, "float32", "raw logits, max_length 8/23/64", ours, theirs)
    assert_as_exact_as_the_oracle(
        arch, pairs, ours, theirs, logit_tolerance(arch), recorder, max_length=max_length, activation_fn=IDENTITY
    )


@pytest.mark.parametrize("arch", ARCHS)
@share(0.25)
@given(pairs=S.pairs)
def test_compiled_raw_logits_equal_crossencoder(arch, pairs, recorder):
    """compile=True: inductor fuses the ops between the GEMMs and attention, one graph serves every batch."""
    compiled = scorer(arch, compile=True)
    ours = compiled.predict(pairs, activation_fn=IDENTITY)
    theirs = oracle(arch).predict(pairs, activation_fn=IDENTITY)
    recorder.add(arch, "float32", "raw logits, compile=True", ours, theirs)
    assert_as_exact_as_the_oracle(arch, pairs, ours, theirs, logit_tolerance(arch), recorder, activation_fn=IDENTITY)
    assert compiled.runner.graphs <= 3, f"{compiled.runner.graphs} graphs for {len(compiled.runner.shapes)} batch shapes"


# Batches that differ in everything but the pairs: page size, token budget, pairs per batch, order.
LAYOUTS = [
    {"page_size": 16, "max_batch_tokens": 8192},
    {"page_size": 1, "max_batch_tokens": 1024},
    {"page_size": 64, "max_batch_tokens": 16384},
    {"page_size": 8, "max_batch_tokens": 512},
]


@pytest.mark.parametrize("arch", ARCHS)
@share(0.3)
@given(pairs=S.mixed_pairs, layout=st.sampled_from(LAYOUTS), data=st.data())
def test_pair_score_independent_of_batchmates_pages_budget_and_order(arch, pairs, layout, data):
    """Scores (what predict returns) agree within 1e-5 whatever the batch. Raw logits agree within
    1e-5 + 1e-5 * |logit|: fp32 GEMMs round differently at the last bit for different row counts, and the
    tiny models' large weights amplify that to ~1e-5 relative (transformers' own logits move as much)."""
    ours = scorer(arch)
    alone_logits = ours.predict(pairs, activation_fn=IDENTITY, batch_size=1)  # each pair in a batch of its own
    order = data.draw(st.permutations(range(len(pairs))))
    batch_size = data.draw(st.one_of(st.none(), st.integers(1, len(pairs))))
    shuffled = [pairs[i] for i in order]
    batched = scorer(arch, **layout)
    logits = np.empty_like(alone_logits)
    logits[list(order)] = batched.predict(shuffled, activation_fn=IDENTITY, batch_size=batch_size)
    np.testing.assert_allclose(logits, alone_logits, atol=1e-5, rtol=1e-5)
    scores = np.empty_like(alone_logits)
    scores[list(order)] = batched.predict(shuffled, batch_size=batch_size)
    alone_scores = ours.activation_fn(torch.from_numpy(alone_logits)).numpy()  # elementwise, as predict applies it
    np.testing.assert_allclose(scores, alone_scores, atol=1e-5, rtol=0 if bounded(arch) else 1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_scores_spread_far_above_tolerance(arch, recorder):
    """Parity proves nothing if every pair gets the same score: the oracle's values must vary a lot."""
    spread = recorder.spread(arch, "float32", "raw logits")
    if spread == 0.0:  # the property above did not run in this session (e.g. -k selection): measure here
        pairs = [(q, d) for q in S.ODD[:8] for d in ("a short passage", " ".join(S.WORDS[:60]))]
        spread = float(np.std(oracle(arch).predict(pairs, activation_fn=IDENTITY)))
    assert spread > 1000 * 1e-5, f"{arch}: raw logit std {spread:.2e} is not far above the 1e-5 tolerance"
    # ... and every label, and the second text alone, move the scores (a model blind to either proves less)
    logits = oracle(arch).predict([(q, d) for q in S.ODD[:8] for d in ("a short passage", " ".join(S.WORDS[:60]))],
                                  activation_fn=IDENTITY).reshape(8, 2, -1)
    assert logits.reshape(16, -1).std(axis=0).min() > 1000 * 1e-5, f"{arch}: a label barely varies"
    assert np.abs(logits[:, 0] - logits[:, 1]).min() > 100 * 1e-5, f"{arch}: the second text barely moves the score"


def test_zoo_models_load_every_weight():
    """Every checkpoint tensor is consumed and every parameter loaded (the loader raises otherwise)."""
    from xenc_lab.loader import build_model, load_config, read_checkpoint

    for arch in ARCHS:
        path = model_dir(arch)
        config = load_config(path)
        model = build_model(config)
        params = {n for n, _ in model.named_parameters()}
        tensors = {k for k in read_checkpoint(path) if not k.endswith("position_ids")}
        assert params == tensors, (arch, sorted(params ^ tensors)[:10])


@pytest.mark.parametrize("arch", ARCHS)
def test_per_pair_linears_are_the_ones_fed_one_row_per_pair(arch):
    """The linears a model lists as per-pair, which float32 leaves torch's (MKL's, as the oracle's) rather than
    prepacked for oneDNN, are exactly those its forward feeds one row per pair (per pair slot of the batch)."""
    from xenc_lab.cpu.prepacked import PrepackedLinear

    if DEVICE != "cpu":
        pytest.skip("prepacking is for the CPU")
    model = scorer(arch).model
    listed = {id(m) for m in model.per_pair_linears()}
    linears = {name: m for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, PrepackedLinear))}
    assert listed and listed <= {id(m) for m in linears.values()}, arch
    batches: list[dict] = []  # per batch: its token and pair-slot counts, and each linear's input rows

    def record(name):
        return lambda module, args: batches[-1][name].add(args[0].reshape(-1, module.in_features).shape[0])

    def new_batch(module, args):
        batches.append(collections.defaultdict(set, T=args[0].input_ids.shape[0], B=args[0].seq_lens.shape[0]))

    hooks = [m.register_forward_pre_hook(record(name)) for name, m in linears.items()]
    hooks.append(model.register_forward_pre_hook(new_batch))
    pairs = [(q, d) for q in S.ODD[:2] for d in ("a short passage", " ".join(S.WORDS[:40]))]
    try:
        scorer(arch).predict(pairs, activation_fn=IDENTITY)
    finally:
        for hook in hooks:
            hook.remove()
    assert any(b["T"] != b["B"] for b in batches), batches
    for name, m in linears.items():
        fed = [(b[name], b["B"]) for b in batches if b["T"] != b["B"]]
        if id(m) in listed:  # one row per pair slot, in every batch
            assert all(rows == {B} for rows, B in fed), (arch, name, fed)
        else:  # token rows (or, in DeBERTa, relative position embeddings), or rows taken apart and never fed whole
            assert all(rows != {B} for rows, B in fed), (arch, name, fed)
        # In float32 the per-pair ones stay torch's, the others are prepacked.
        assert isinstance(m, PrepackedLinear) == (id(m) not in listed), (arch, name, type(m).__name__)


# -- what a call may ask for, a CrossEncoder save's own settings, and the engine's other paths ---------------------
ACTIVATIONS = {"identity": IDENTITY, "sigmoid": torch.nn.Sigmoid(), "tanh": torch.nn.Tanh()}


@pytest.mark.parametrize("arch", ARCHS)
@share(0.2)
@given(pairs=S.pairs, max_length=st.sampled_from([None, 8, 23]), as_processing_kwargs=st.booleans(),
       prompt=st.none() | S.short_text, activation=st.sampled_from(sorted(ACTIVATIONS)))
def test_per_call_options_equal_crossencoder(arch, pairs, max_length, as_processing_kwargs, prompt, activation, recorder):
    """predict's options, as the oracle's predict takes them: a max_length for the call (``max_length=`` or
    ``processing_kwargs``), a prompt prepended to text_1, an activation. Compared at the logits' tolerance (the
    activations here do not magnify differences)."""
    options = {"activation_fn": ACTIVATIONS[activation], "prompt": prompt}
    if max_length is not None:
        options.update({"processing_kwargs": {"text": {"max_length": max_length}}} if as_processing_kwargs
                       else {"max_length": max_length})
    ours = scorer(arch).predict(pairs, **options)
    theirs = oracle(arch).predict(pairs, **options)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    recorder.add(arch, "float32", "per-call options", ours, theirs)
    assert_as_exact_as_the_oracle(arch, pairs, ours, theirs, logit_tolerance(arch), recorder, **options)


@functools.cache
def crossencoder_save(arch: str, layout: str) -> str:
    """The zoo model saved by CrossEncoder.save_pretrained, then given what a save may carry: a Tanh activation,
    prompts with a default, a max_seq_length, do_lower_case, and (``layout="subfolder"``) its Transformer module in
    a folder of its own."""
    import json
    import shutil

    from sentence_transformers import CrossEncoder

    from .conftest import ROOT

    target = ROOT / "saves" / f"{arch}-{layout}"
    if target.exists():
        shutil.rmtree(target)
    CrossEncoder(str(model_dir(arch)), device="cpu").save_pretrained(str(target))
    edit = lambda name, **changes: (target / name).write_text(
        json.dumps({**json.loads((target / name).read_text()), **changes}))
    edit("config_sentence_transformers.json", activation_fn="torch.nn.modules.activation.Tanh",
         prompts={"query": "query: ", "search": "Search Query: "}, default_prompt_name="query")
    edit("sentence_bert_config.json", max_seq_length=40, do_lower_case=True)
    if layout == "subfolder":
        module = target / "0_Transformer"
        module.mkdir()
        for file in list(target.iterdir()):
            if file.name not in ("modules.json", "config_sentence_transformers.json", "README.md", module.name):
                shutil.move(str(file), str(module / file.name))
        modules = json.loads((target / "modules.json").read_text())
        modules[0]["path"] = module.name
        (target / "modules.json").write_text(json.dumps(modules))
    return str(target)


@functools.cache
def _save_engines(arch: str, layout: str):
    from sentence_transformers import CrossEncoder

    from xenc_lab import Scorer

    path = crossencoder_save(arch, layout)
    exact = CrossEncoder(path, device="cpu", model_kwargs={"dtype": torch.float64})  # arbitrates, as exact_oracle
    return Scorer(path, device=DEVICE), CrossEncoder(path, device="cpu"), exact


@pytest.mark.parametrize("arch, layout", [("bert", "root"), ("roberta", "subfolder"), ("deberta-v3", "root")])
@share(0.2)
@given(pairs=S.pairs, prompt_name=st.sampled_from([None, "search"]), prompt=st.sampled_from([None, ""]))
def test_a_crossencoder_save_scores_as_the_oracle_loads_it(arch, layout, pairs, prompt_name, prompt, recorder):
    """Its activation, its default prompt (or another by name, or none with prompt=""), its max_seq_length and
    do_lower_case, wherever its Transformer module sits."""
    ours, theirs, exact = _save_engines(arch, layout)
    assert ours.max_length == theirs.max_seq_length == 40 and isinstance(ours.activation_fn, torch.nn.Tanh)
    with warnings.catch_warnings():  # a prompt with a prompt_name warns (the prompt wins, in both)
        warnings.simplefilter("ignore", UserWarning)
        got = ours.predict(pairs, prompt_name=prompt_name, prompt=prompt)
    want = theirs.predict(pairs, prompt_name=prompt_name, prompt=prompt)
    recorder.add(arch, "float32", "a CrossEncoder save's settings", got, want)
    tolerance = {"atol": logit_tolerance(arch)["atol"], "rtol": 0}  # tanh: within its logits'
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert_as_exact_as_the_oracle(arch, pairs, got, want, tolerance, recorder, exact=exact,
                                      prompt_name=prompt_name, prompt=prompt)


def test_more_pairs_than_one_window_equal_crossencoder(recorder):
    """Past the first 1,024 pairs, windows are tokenized while the model runs: each lands in its own rows."""
    pairs = [(S.WORDS[i % len(S.WORDS)], " ".join(S.WORDS[(i * 7) % 50 : (i * 7) % 50 + 3 + i % 90])) for i in range(2100)]
    ours = scorer("bert").predict(pairs, activation_fn=IDENTITY)
    theirs = oracle("bert").predict(pairs, activation_fn=IDENTITY)
    recorder.add("bert", "float32", "raw logits, 2,100 pairs", ours, theirs)
    np.testing.assert_allclose(ours, theirs, **logit_tolerance("bert"))
    assert np.std(theirs[1024:]) > 0.1 and np.std(theirs[2048:]) > 0.1


@pytest.mark.parametrize("arch", [a for a in ARCHS if not a.startswith("minilm")])
@share(0.2)
@given(pairs=S.pairs)
def test_raw_logits_on_the_sdpa_attention_path_equal_crossencoder(arch, pairs, recorder):
    """The CPU runs SDPA where the attention kernel cannot be built (and CUDA in float32): the per-pair layout, the
    key masks, ModernBERT's windows. Forced here for the call (the path is read at each forward)."""
    import os

    if DEVICE != "cpu":
        pytest.skip("the CPU attention paths")
    before = os.environ.get("XENC_LAB_CPU_ATTENTION")
    os.environ["XENC_LAB_CPU_ATTENTION"] = "sdpa"
    try:
        ours = scorer(arch).predict(pairs, activation_fn=IDENTITY)
    finally:
        if before is None:
            del os.environ["XENC_LAB_CPU_ATTENTION"]
        else:
            os.environ["XENC_LAB_CPU_ATTENTION"] = before
    theirs = oracle(arch).predict(pairs, activation_fn=IDENTITY)
    recorder.add(arch, "float32", "raw logits, SDPA attention", ours, theirs)
    assert_as_exact_as_the_oracle(arch, pairs, ours, theirs, logit_tolerance(arch), recorder, activation_fn=IDENTITY)
