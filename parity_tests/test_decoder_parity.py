"""Properties that prove xenc_lab scores decoder-LLM rerankers as sentence-transformers' CrossEncoder does.

Every spec of xenc_lab.zoo.decoders.DECODER_SPECS (conftest.DECODERS): Qwen3/Qwen2/Llama causal LMs scored as logit("yes") -
logit("no") at the last token (ST's LogitScore), and Qwen3/Llama sequence classifiers, behind chat templates of
different shapes (and one without a template). The oracle is ``CrossEncoder(path, device="cpu",
model_kwargs={"dtype": torch.float32})``.

What is proven, per spec:
- raw scores (Identity) on pairs in three shapes: 1:1 (independent pairs), 1:N (``Scorer.score`` and ``Scorer.rank``
  against ``CrossEncoder.predict`` and ``CrossEncoder.rank``) and N:N (several queries' documents shuffled together);
  activated scores (the default sigmoid, and softmax); truncation at small max_lengths (the template's suffix
  restored); compile=True; per-call prompts (a system message), max_length and activations; a CrossEncoder save
  (Transformer + LogitScore modules, saved prompts and a default one, a template variable);
- prefix sharing: share_prefix=True scores as share_prefix=False, it really computes fewer tokens, and a pair's score
  does not depend on which pairs share its prefix, nor on page size, token budget, batch size or order;
- bfloat16 (where the CPU has bf16 units): the mean |error| against CrossEncoder fp32 is at most 1.5x CrossEncoder's
  own bfloat16 mean |error| on a fixed set of pairs;
- the scores spread far above the tolerance (parity of constant scores would prove nothing);
- refusals: share_prefix=True on an encoder, a tokenizer without "yes"/"no", a template that cannot carry a
  query/document pair, an unsupported architecture (the message lists the supported ones).
Token ids against ``CrossEncoder.preprocess`` are tests/test_chat_tokenize.py's, not repeated here.

Tolerances, as test_parity.py's: raw scores within abs 1e-5 x (the spec's score scale, at least 1) + rel 1e-4, where
the scale is the std of the oracle's raw scores on a fixed probe set; activated scores in [0, 1] within 1e-5. Outside
it, ours must be no further from CrossEncoder in float64 than twice CrossEncoder's fp32 error (plus the tolerance).
That float64 oracle scores each pair alone, with transformers' RMSNorms kept in float64: CrossEncoder left-pads a
batch and, passing no position ids, starts a padded row's positions at its pad count, and the rotary angles (float32
in every dtype) then round differently. Its scores depend on their batchmates by that much (7e-5 on a
qwen2-doc-instruction score of -0.24, measured, in float64 too), ours do not.
Comparisons of ours with ours (sharing or not, batchmates) are within abs 1e-5 x scale + rel 1e-5.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xenc_lab import Scorer
from xenc_lab.cpu.info import native_half_units

from xenc_lab.zoo.corpus import SPREAD_PAIRS
from xenc_lab.zoo.decoders import CHATML_TEMPLATE, DECODER_SPECS, without_yes_no

from . import strategies as S
from .arbitration import arbitrate, scaled_tolerance
from .conftest import DECODERS, DEVICE, ROOT, model_dir, scorer

IDENTITY = torch.nn.Identity()
NAMES = list(DECODERS)
CAUSAL = [n for n in NAMES if DECODER_SPECS[n].architecture.endswith("ForCausalLM")]

# The probe set of the score scale and the spread: varied sentences, odd texts, a short and a long document.
PROBE = SPREAD_PAIRS + [(q, d) for q in S.ODD[:8] for d in ("a short passage", " ".join(S.WORDS[:60]))]


def examples(n: int) -> settings:
    """``n`` examples under the "ci" profile (110 examples), as many more or fewer under the others."""
    return settings(max_examples=max(3, round(n * settings.default.max_examples / 110)))


@functools.cache
def oracle(name: str, dtype: str = "float32", max_length: int | None = None):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(model_dir(name)), device="cpu", max_length=max_length,
                        model_kwargs={"dtype": getattr(torch, dtype)})


@functools.cache
def score_scale(name: str) -> float:
    """Std of the oracle's raw scores on the probe set."""
    return float(np.std(oracle(name).predict(PROBE, activation_fn=IDENTITY)))


def raw_tolerance(name: str) -> dict:
    return scaled_tolerance(score_scale(name))


def self_tolerance(name: str) -> dict:
    """Ours against ours (the same model run in other batches): fp32 rounding only."""
    return scaled_tolerance(score_scale(name), rtol=1e-5)


@contextlib.contextmanager
def exact_rms_norms():
    """transformers' RMSNorms in the input's dtype: they compute in float32 whatever it is (a float64 model would
    round to float32 at every norm, and its error would follow fp32's). The rotary angles stay float32, as in both
    engines: that is the function computed."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    def gemma_forward(self, x):  # Gemma's scale is (1 + weight)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    patches = {LlamaRMSNorm: forward, Qwen2RMSNorm: forward, Qwen3RMSNorm: forward, GemmaRMSNorm: gemma_forward}
    saved = {cls: cls.forward for cls in patches}
    try:
        for cls, method in patches.items():
            cls.forward = method
        yield
    finally:
        for cls, method in saved.items():
            cls.forward = method


def assert_parity(name, pairs, ours, theirs, tolerance, recorder, max_length=None, **predict_kwargs):
    """The suite's rule (arbitration.py), against CrossEncoder in float64 scoring each pair alone with exact RMSNorms:
    a left-padded row's positions start at its pad count (see above)."""

    def exact():
        with exact_rms_norms():
            return oracle(name, "float64", max_length).predict(pairs, batch_size=1, **predict_kwargs)

    arbitrate(name, ours, theirs, tolerance, recorder, exact)


def flatten(groups) -> list[tuple[str, str]]:
    return [(q, d) for q, docs in groups for d in docs]


# -- parity with CrossEncoder, in the three shapes of a reranker's input -------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@examples(20)
@given(pairs=S.decoder_pairs)
def test_raw_scores_of_independent_pairs_equal_crossencoder(name, pairs, recorder):
    ours = scorer(name).predict(pairs, activation_fn=IDENTITY)
    theirs = oracle(name).predict(pairs, activation_fn=IDENTITY)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape == (len(pairs),)
    recorder.add(name, "float32", "raw scores", ours, theirs)
    assert_parity(name, pairs, ours, theirs, raw_tolerance(name), recorder, activation_fn=IDENTITY)


@pytest.mark.parametrize("name", NAMES)
@examples(12)
@given(query_documents=S.query_documents)
def test_one_query_many_documents_score_and_rank_equal_crossencoder(name, query_documents, recorder):
    """1:N through ``score(query, documents)`` (raw and activated) and ``rank`` against ``CrossEncoder.rank``: the
    same scores per corpus_id, and our order is theirs wherever their scores are further apart than the tolerance."""
    query, documents = query_documents
    pairs = [(query, d) for d in documents]
    ours_scorer = scorer(name)
    raw = ours_scorer.score(query, documents, activation_fn=IDENTITY)
    assert ours_scorer.token_counts.computed <= ours_scorer.token_counts.total
    theirs_raw = oracle(name).predict(pairs, activation_fn=IDENTITY)
    recorder.add(name, "float32", "raw scores", raw, theirs_raw)
    recorder.add(name, "float32", "raw scores, 1:N", raw, theirs_raw)
    assert_parity(name, pairs, raw, theirs_raw, raw_tolerance(name), recorder, activation_fn=IDENTITY)

    ranked = ours_scorer.rank(query, documents, return_documents=True)
    theirs_ranked = oracle(name).rank(query, documents, return_documents=True)
    assert sorted(r["corpus_id"] for r in ranked) == list(range(len(documents)))
    assert all(r["text"] == documents[r["corpus_id"]] for r in ranked)
    ours_by_id = np.array([r["score"] for r in sorted(ranked, key=lambda r: r["corpus_id"])])
    theirs_by_id = np.array([r["score"] for r in sorted(theirs_ranked, key=lambda r: r["corpus_id"])])
    recorder.add(name, "float32", "rank scores, 1:N", ours_by_id, theirs_by_id)
    # Activated scores within the raw scores' tolerance: a sigmoid or softmax moves by at most a quarter of what its
    # logits move, so a fixed 1e-5 here would be stricter than the raw check on models with large logits.
    assert_parity(name, pairs, ours_by_id, theirs_by_id, raw_tolerance(name), recorder)
    np.testing.assert_allclose(ours_scorer.score(query, documents), ours_by_id, atol=1e-7, rtol=0)
    order = [r["corpus_id"] for r in ranked]
    for before, after in itertools.pairwise(order):  # each pair ranked above the next by them too, up to the tolerance
        assert theirs_by_id[before] >= theirs_by_id[after] - 2e-5, (order, [r["corpus_id"] for r in theirs_ranked])


@pytest.mark.parametrize("name", NAMES)
@examples(12)
@given(groups=S.queries_documents, data=st.data())
def test_many_queries_documents_shuffled_together_equal_crossencoder(name, groups, data, recorder):
    """N:N: several queries' documents shuffled into one call (predict, and score's N:N form)."""
    pairs = flatten(groups)
    order = data.draw(st.permutations(range(len(pairs))))
    shuffled = [pairs[i] for i in order]
    ours = scorer(name).predict(shuffled, activation_fn=IDENTITY)
    theirs = oracle(name).predict(shuffled, activation_fn=IDENTITY)
    recorder.add(name, "float32", "raw scores", ours, theirs)
    recorder.add(name, "float32", "raw scores, N:N shuffled", ours, theirs)
    assert_parity(name, shuffled, ours, theirs, raw_tolerance(name), recorder, activation_fn=IDENTITY)
    as_score = scorer(name).score([q for q, _ in shuffled], [d for _, d in shuffled], activation_fn=IDENTITY)
    np.testing.assert_array_equal(as_score, ours)


@pytest.mark.parametrize("name", NAMES)
@examples(8)
@given(pairs=S.decoder_pairs, softmax=st.booleans())
def test_activated_scores_equal_crossencoder(name, pairs, softmax, recorder):
    """The default activation (sigmoid: a LogitScore's one label, and the seq-cls heads' one label), or softmax."""
    ours_scorer = scorer(name)
    assert isinstance(ours_scorer.activation_fn, torch.nn.Sigmoid)
    ours = ours_scorer.predict(pairs, apply_softmax=softmax)
    theirs = oracle(name).predict(pairs, apply_softmax=softmax)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    recorder.add(name, "float32", "activated scores", ours, theirs)
    assert_parity(name, pairs, ours, theirs, raw_tolerance(name), recorder, apply_softmax=softmax)


def small_max_length(name: str, which) -> int:
    """A max_length for ``name``: "least" (its template's suffix and one token: a cut row is almost all suffix),
    "least+5", or a number of tokens past "least" where the template alone is longer (Gemma's prompt)."""
    least = scorer(name).tokenizer.specials
    if isinstance(which, str):
        return {"least": least, "least+5": least + 5}[which]
    return which if which > least else least + which


@pytest.mark.parametrize("name", NAMES)
@examples(10)
@given(pairs=S.decoder_pairs, which=st.sampled_from(["least", "least+5", 40, 97]))
def test_truncation_at_small_max_length_equals_crossencoder(name, pairs, which, recorder):
    """Rows cut to max_length (on the tokenizer's side: llama-bare cuts from the left), the template's suffix
    written back over their end, as CrossEncoder(max_length=...) does."""
    max_length = small_max_length(name, which)
    ours_scorer = scorer(name, max_length=max_length)
    assert ours_scorer.max_length == oracle(name, max_length=max_length).max_seq_length == max_length
    ours = ours_scorer.predict(pairs, activation_fn=IDENTITY)
    theirs = oracle(name, max_length=max_length).predict(pairs, activation_fn=IDENTITY)
    recorder.add(name, "float32", "raw scores, small max_length", ours, theirs)
    assert_parity(name, pairs, ours, theirs, raw_tolerance(name), recorder, max_length=max_length,
                  activation_fn=IDENTITY)


# One query's documents: its prefix computed once into the cache, then the documents over it (compiling is slow: a
# few graphs, and sharing's two kinds of batches are what compile=True adds to the eager path's).
COMPILE_PAIRS = [("what is the tallest mountain on the planet and how was its height measured by the survey", d)
                 for d in ("everest is the tallest mountain", "the ocean is the deepest water",
                           "the river is the longest water")]


@pytest.mark.parametrize("name", CAUSAL)  # the seq-cls specs share the decoder; only their head differs
def test_compiled_raw_scores_equal_crossencoder(name, recorder):
    """compile=True, one call per spec (compiling is slow): inductor fuses what lies between the GEMMs and attention.
    The shared prefix's batch (one chunk, no context, stored) and the documents' (three chunks over the cache, none
    stored) take a graph each: dynamo specializes a size of 1, and an empty write index has stride 0 (2 graphs here;
    documents of lengths the planner splits take a third). At most 3, the encoders' bound."""
    compiled = scorer(name, compile=True)
    ours = compiled.predict(COMPILE_PAIRS, activation_fn=IDENTITY)
    theirs = oracle(name).predict(COMPILE_PAIRS, activation_fn=IDENTITY)
    recorder.add(name, "float32", "raw scores, compile=True", ours, theirs)
    assert_parity(name, COMPILE_PAIRS, ours, theirs, raw_tolerance(name), recorder, activation_fn=IDENTITY)
    assert compiled.token_counts.computed < compiled.token_counts.total  # the prefix was shared
    assert compiled.runner.graphs <= 3, f"{compiled.runner.graphs} graphs for {len(compiled.runner.shapes)} shapes"


ACTIVATIONS = {"identity": IDENTITY, "sigmoid": torch.nn.Sigmoid(), "tanh": torch.nn.Tanh()}
INSTRUCTIONS = ["Judge strictly whether the passage answers the question",
                "Given a web search query, retrieve relevant passages that answer the query",
                "Zürich <|im_end|>\n<think> 🙂"]


@pytest.mark.parametrize("name", NAMES)
@examples(12)
@given(pairs=S.decoder_pairs, prompt=st.none() | st.sampled_from(INSTRUCTIONS) | S.short_text,
       which=st.sampled_from([None, "least", "least+5", 48]), as_processing_kwargs=st.booleans(),
       activation=st.sampled_from(sorted(ACTIVATIONS)))
def test_per_call_prompts_max_length_and_activation_equal_crossencoder(name, pairs, prompt, which,
                                                                       as_processing_kwargs, activation, recorder):
    """A prompt per call (a system message where there is a template: the instruction; prepended to text_1 where
    there is none), a max_length per call (``max_length=`` or ``processing_kwargs``), an activation."""
    options = {"activation_fn": ACTIVATIONS[activation], "prompt": prompt}
    if which is not None:
        max_length = small_max_length(name, which)
        options.update({"processing_kwargs": {"text": {"max_length": max_length}}} if as_processing_kwargs
                       else {"max_length": max_length})
    ours = scorer(name).predict(pairs, **options)
    theirs = oracle(name).predict(pairs, **options)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    recorder.add(name, "float32", "per-call prompt, max_length, activation", ours, theirs)
    assert_parity(name, pairs, ours, theirs, raw_tolerance(name), recorder, **options)


# -- prefix sharing ------------------------------------------------------------------------------------------------
# Layouts that share differently: the default (shared runs of a page or more), a page of one token (every common
# token run shared, the bos alone included), small pages under a small token budget (long pairs run in chunks).
SHARING_LAYOUTS = [
    {},
    {"page_size": 1, "max_batch_tokens": 1024},
    {"page_size": 8, "max_batch_tokens": 512},
    {"page_size": 64, "max_batch_tokens": 16384},
]


@pytest.mark.parametrize("name", NAMES)
@examples(12)
@given(groups=st.one_of(S.query_documents.map(lambda qd: [qd]), S.queries_documents),
       layout=st.sampled_from(SHARING_LAYOUTS), data=st.data())
def test_sharing_prefixes_scores_as_not_sharing(name, groups, layout, data):
    """share_prefix=True against share_prefix=False on 1:N and N:N inputs, shuffled; the tokens computed never
    exceed the tokens scored, which no sharing computes all of."""
    pairs = flatten(groups)
    order = data.draw(st.permutations(range(len(pairs))))
    pairs = [pairs[i] for i in order]
    shared, unshared = scorer(name, share_prefix=True, **layout), scorer(name, share_prefix=False, **layout)
    with_sharing = shared.predict(pairs, activation_fn=IDENTITY)
    without = unshared.predict(pairs, activation_fn=IDENTITY)
    np.testing.assert_allclose(with_sharing, without, **self_tolerance(name))
    assert shared.token_counts.total == unshared.token_counts.total == unshared.token_counts.computed
    assert shared.token_counts.computed <= shared.token_counts.total


@pytest.mark.parametrize("name", NAMES)
def test_sharing_really_happens_on_one_query_with_many_documents(name):
    """On a 1:N input the common prefix of the pairs' ids is computed once: at most total - (N - 1) x its length
    tokens are computed (fewer where documents share more), and the default (share_prefix=None) shares."""
    query = "what is the " + " ".join(S.WORDS[40:70])
    documents = ["everest is the tallest mountain", "the ocean", "", " ".join(S.WORDS[:50]), "a recipe for bread"]
    assert scorer(name).share_prefix is True
    ours = scorer(name)
    ours.predict([(query, d) for d in documents])
    enc = ours.tokenizer([query] * len(documents), documents)
    rows = [np.asarray(enc.pair(i)) for i in range(len(documents))]
    common = min(len(r) for r in rows)
    for r in rows[1:]:
        differ = np.flatnonzero(rows[0][:common] != r[:common])
        common = int(differ[0]) if len(differ) else common
    common = min(common, min(len(r) for r in rows) - 1)  # every pair keeps its last token (its logits) to itself
    assert common >= ours.config.page_size, f"{name}: the pairs share only {common} tokens"
    total = sum(len(r) for r in rows)
    assert ours.token_counts.total == total
    assert ours.token_counts.computed <= total - (len(documents) - 1) * common, (ours.token_counts, common)
    unshared = scorer(name, share_prefix=False)
    unshared.predict([(query, d) for d in documents])
    assert unshared.token_counts.computed == unshared.token_counts.total == total


@pytest.mark.parametrize("name", NAMES)
@examples(8)
@given(groups=S.queries_documents, layout=st.sampled_from(SHARING_LAYOUTS), data=st.data())
def test_pair_score_independent_of_what_shares_its_prefix(name, groups, layout, data):
    """A pair scored alone, among the other documents of its query (1:N), and among every query's pairs (N:N) in any
    order, batch size, page size and token budget: the same raw score up to fp32 rounding."""
    pairs = flatten(groups)
    ours = scorer(name)
    alone = np.array([ours.predict([pair], activation_fn=IDENTITY)[0] for pair in pairs])
    query, documents = groups[0]
    one_query = ours.predict([(query, d) for d in documents], activation_fn=IDENTITY)
    np.testing.assert_allclose(one_query, alone[: len(documents)], **self_tolerance(name))
    order = data.draw(st.permutations(range(len(pairs))))
    batch_size = data.draw(st.none() | st.integers(1, len(pairs)))
    batched = np.empty_like(alone)
    batched[list(order)] = scorer(name, **layout).predict([pairs[i] for i in order], activation_fn=IDENTITY,
                                                           batch_size=batch_size)
    np.testing.assert_allclose(batched, alone, **self_tolerance(name))


def test_more_pairs_than_one_window_equal_crossencoder(recorder):
    """Past the first 1,024 pairs windows are tokenized (and their prefixes shared) on their own: a query's documents
    that straddle the window's end are scored as the oracle scores them."""
    name = "llama-bare"
    pairs = [(f"query {S.WORDS[i // 90]} " + " ".join(S.WORDS[: 5 + i // 300]),
              " ".join(S.WORDS[(i * 7) % 50: (i * 7) % 50 + 2 + i % 40])) for i in range(1100)]
    ours = scorer(name).predict(pairs, activation_fn=IDENTITY)
    theirs = oracle(name).predict(pairs, activation_fn=IDENTITY)
    recorder.add(name, "float32", "raw scores, 1,100 pairs", ours, theirs)
    assert_parity(name, pairs, ours, theirs, raw_tolerance(name), recorder, activation_fn=IDENTITY)
    assert scorer(name).token_counts.computed < scorer(name).token_counts.total
    assert np.std(theirs[1024:]) > 0.1


# -- bfloat16 ------------------------------------------------------------------------------------------------------
BF16_PAIRS = PROBE + [("what is the tallest mountain on the planet", d) for d in
                      ("everest is the tallest mountain", "the ocean is deep", " ".join(S.WORDS[:80]))]


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_error_is_within_one_and_a_half_times_crossencoders_own(name, recorder):
    """Scorer(dtype="bfloat16") against CrossEncoder fp32: the mean |error| over BF16_PAIRS is at most 1.5x that of
    CrossEncoder(model_kwargs={"dtype": torch.bfloat16}) (the max |errors| are in the report)."""
    if DEVICE == "cpu" and not native_half_units("bfloat16"):
        pytest.skip("bfloat16 on a CPU without AMX or AVX512-BF16 units runs as fp32 GEMMs on bf16 values")
    exact = oracle(name).predict(BF16_PAIRS, activation_fn=IDENTITY)
    theirs = oracle(name, "bfloat16").predict(BF16_PAIRS, activation_fn=IDENTITY)
    ours = scorer(name, dtype="bfloat16").predict(BF16_PAIRS, activation_fn=IDENTITY)
    ours_error = recorder.add(name, "bfloat16", "raw scores vs CrossEncoder fp32", ours, exact)
    their_error = recorder.add(name, "bfloat16", "(CrossEncoder's own bf16 vs its fp32)", theirs, exact)
    assert np.isfinite(ours).all() and ours_error.mean() > 0  # bfloat16 did run
    assert ours_error.mean() <= 1.5 * their_error.mean(), (
        f"{name}: bf16 mean |error| {ours_error.mean():.3e} (max {ours_error.max():.3e}) over 1.5x CrossEncoder's own "
        f"{their_error.mean():.3e} (max {their_error.max():.3e})")


# -- parity that proves something ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_scores_spread_far_above_tolerance(name, recorder):
    """The oracle's raw scores vary far more than the tolerance over varied pairs, and both the query and the
    document move them (a model blind to either proves less)."""
    spread = max(recorder.spread(name, "float32", "raw scores"), score_scale(name))
    assert spread > 1000 * raw_tolerance(name)["atol"], f"{name}: raw score std {spread:.2e}"
    pairs = [(q, d) for q in S.ODD[:8] for d in ("a short passage", " ".join(S.WORDS[:60]))]
    scores = oracle(name).predict(pairs, activation_fn=IDENTITY).reshape(8, 2)
    assert scores.std(axis=0).min() > 1000 * 1e-5, f"{name}: the query barely moves the score"
    assert np.abs(scores[:, 0] - scores[:, 1]).min() > 100 * 1e-5, f"{name}: the document barely moves the score"


# -- a CrossEncoder save -------------------------------------------------------------------------------------------
SAVED_PROMPTS = {"strict": "Judge strictly whether the passage answers the question",
                 "web": "Given a web search query, retrieve relevant passages that answer the query"}


@functools.cache
def crossencoder_save(name: str) -> str:
    """The spec saved by ``CrossEncoder.save`` (a causal LM: Transformer and LogitScore modules), then given saved
    prompts with a default (an instruction: a system message), a max_seq_length, and for qwen2-doc-instruction a
    template variable (``processing_kwargs``' chat_template: its instruction)."""
    target = ROOT / "saves" / f"decoder-{name}"
    if target.exists():
        shutil.rmtree(target)
    oracle(name).save(str(target))
    edit = lambda file, **changes: (target / file).write_text(
        json.dumps({**json.loads((target / file).read_text()), **changes}))
    edit("config_sentence_transformers.json", prompts=SAVED_PROMPTS, default_prompt_name="strict")
    edit("sentence_bert_config.json", max_seq_length=120)
    if name == "qwen2-doc-instruction":
        edit("sentence_bert_config.json", processing_kwargs={"chat_template": {"instruction": "Is it on topic?"}})
    return str(target)


@functools.cache
def _save_engines(name: str):
    from sentence_transformers import CrossEncoder

    path = crossencoder_save(name)
    return Scorer(path, device=DEVICE), CrossEncoder(path, device="cpu", model_kwargs={"dtype": torch.float32})


@pytest.mark.parametrize("name", NAMES)
@examples(6)
@given(pairs=S.decoder_pairs, prompt_name=st.sampled_from([None, "web"]), prompt=st.sampled_from([None, ""]))
def test_a_crossencoder_save_scores_as_the_oracle_loads_it(name, pairs, prompt_name, prompt, recorder):
    """Its modules (a LogitScore after the Transformer for a causal LM), its default prompt (or another by name, or
    none with prompt=""), its max_seq_length, a template variable."""
    ours, theirs = _save_engines(name)
    modules = [m["type"] for m in json.loads((Path(crossencoder_save(name)) / "modules.json").read_text())]
    if name in CAUSAL:
        assert modules == ["sentence_transformers.base.modules.transformer.Transformer",
                           "sentence_transformers.cross_encoder.modules.logit_score.LogitScore"]
    assert ours.max_length == theirs.max_seq_length == 120
    with warnings.catch_warnings():  # a prompt with a prompt_name warns (the prompt wins, in both)
        warnings.simplefilter("ignore", UserWarning)
        got = ours.predict(pairs, prompt_name=prompt_name, prompt=prompt, activation_fn=IDENTITY)
        activated = ours.predict(pairs, prompt_name=prompt_name, prompt=prompt)
    want = theirs.predict(pairs, prompt_name=prompt_name, prompt=prompt, activation_fn=IDENTITY)
    want_activated = theirs.predict(pairs, prompt_name=prompt_name, prompt=prompt)
    recorder.add(name, "float32", "a CrossEncoder save's settings", got, want)

    def exact(**activation):  # the save in float64, each pair alone, exact RMSNorms: as assert_parity's oracle
        with exact_rms_norms(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return _save_oracle64(name).predict(pairs, batch_size=1, prompt_name=prompt_name, prompt=prompt,
                                                **activation)

    arbitrate(name, got, want, raw_tolerance(name), recorder, lambda: exact(activation_fn=IDENTITY))
    # activated: within the raw tolerance (a sigmoid or softmax moves by at most a quarter of what its logits move)
    arbitrate(name, activated, want_activated, raw_tolerance(name), recorder, exact)


@functools.cache
def _save_oracle64(name: str):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(crossencoder_save(name), device="cpu", model_kwargs={"dtype": torch.float64})


# -- refusals ------------------------------------------------------------------------------------------------------
def test_share_prefix_true_on_an_encoder_is_refused():
    with pytest.raises(ValueError, match="share_prefix=True needs a decoder reranker"):
        Scorer(model_dir("bert"), device=DEVICE, share_prefix=True)
    assert Scorer(model_dir("bert"), device=DEVICE, share_prefix=False).share_prefix is False


def _copy(name: str, tmp_path):
    path = tmp_path / name
    shutil.copytree(model_dir(name), path)
    return path


def test_a_decoder_whose_tokenizer_lacks_yes_and_no_is_refused(tmp_path):
    from sentence_transformers import CrossEncoder

    path = without_yes_no("qwen3-reranker", ROOT, tmp_path / "model")
    with pytest.raises(ValueError, match="does not have 'yes' and/or 'no' tokens"):
        CrossEncoder(str(path), device="cpu")
    with pytest.raises(ValueError, match="no 'yes' and 'no' token"):
        Scorer(path, device=DEVICE)


def test_a_decoder_whose_template_cannot_carry_a_pair_is_refused(tmp_path):
    path = _copy("qwen3-reranker", tmp_path)
    (path / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    with pytest.raises(ValueError, match="cannot carry a 'query'/'document' pair"):
        Scorer(path, device=DEVICE)


def test_an_unsupported_architecture_is_refused_listing_the_supported_ones(tmp_path):
    path = _copy("llama-bare", tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ValueError, match="'MistralForCausalLM' is not supported") as refusal:
        Scorer(path, device=DEVICE)
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3ForSequenceClassification",
                      "LlamaForSequenceClassification", "BertForSequenceClassification"):
        assert supported in str(refusal.value)
