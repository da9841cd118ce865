"""Long documents on encoders (``long_documents="max"``, ``"mean"``, ``"first"``): text_2 scored in windows of its own
tokens beside the truncated text_1.

The reference is independent of xenc_lab's tokenization: the tokenizer's own truncated pair (transformers'
``truncation="longest_first"``) gives the truncated text_1 and the window's width, text_2 tokenized alone gives the
windows' tokens, and each window's ids are the truncated pair's with its text_2 tokens swapped for the window's; the
windows' scores come from transformers' model on those ids. Also: the first windows score bit for bit as the truncated
pairs (so "max" is never below "truncate"; "first" is "truncate"), a document that fits scores the same in every mode,
options per call and their checks; then the same on a decoder reranker, whose windows keep its chat template."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parity_tests import strategies as S
from xenc_lab import Scorer, engine
from xenc_lab.long_documents import aggregate, spans, windowed_pairs

LONG = " ".join(S.WORDS * 2)  # about 240 tokens: several windows at max_length 64
PAIRS = [
    ("how tall is everest", "Everest is 8,849 m high."),  # fits
    ("a query about rivers", LONG),
    ("a very long query about mountains " * 12, LONG),  # text_1 cut too: half the budget each
    ("", LONG),
    ("q", ""),
]
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def scorer32(tiny_dir):
    return Scorer(tiny_dir, device="cpu", max_length=32)


def reference_windows(tokenizer, text_1: str, text_2: str, max_length: int, stride: int | None):
    """Each window's (ids, type ids) from transformers' tokenizer: its truncated pair with the text_2 tokens replaced
    by a slice of text_2's own tokens, as wide as the truncated pair's, every ``stride`` tokens (half a window)."""
    pair = tokenizer([text_1], [text_2], truncation="longest_first", max_length=max_length)  # as a batch: "" a text
    seq, ids, types = pair.sequence_ids(0), pair["input_ids"][0], pair["token_type_ids"][0]
    doc = tokenizer(text_2, add_special_tokens=False)["input_ids"]
    where = [i for i, s in enumerate(seq) if s == 1]
    if not where:
        return [(ids, types)]
    first, last = where[0], where[-1] + 1
    width = last - first
    from_left = tokenizer.truncation_side == "left"
    assert ids[first:last] == (doc[len(doc) - width :] if from_left else doc[:width]), "text_2 alone, cut"
    step = min(stride or max(1, width // 2), width)
    starts = [0]
    while starts[-1] + width < len(doc):
        starts.append(starts[-1] + step)
    cuts = [(max(0, len(doc) - a - width), len(doc) - a) if from_left else (a, a + width) for a in starts]
    return [(ids[:first] + doc[a:b] + ids[last:], types[:first] + [types[first]] * len(doc[a:b]) + types[last:])
            for a, b in cuts]


def reference_scores(oracle, rows) -> np.ndarray:
    """transformers' scores (the save's activation) of rows of (ids, type ids), one row at a time."""
    out = []
    with torch.no_grad():
        for ids, types in rows:
            logits = oracle.model(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits
            out.append(oracle.activation_fn(logits.float()).item())
    return np.array(out)


def our_windows(tok, pairs, max_length=None, stride=None) -> list[list[tuple[list[int], list[int]]]]:
    enc = windowed_pairs(tok, [p[0] for p in pairs], [p[1] for p in pairs], max_length, stride=stride)
    per_pair = [[] for _ in pairs]
    for row, pair in enumerate(enc.owner):
        a, b = enc.offsets[row], enc.offsets[row + 1]
        per_pair[pair].append((enc.ids[a:b].tolist(), enc.type_ids[a:b].tolist()))
    return per_pair


# -- the windows ------------------------------------------------------------------------------------
@pytest.mark.parametrize("stride", [None, 1, 7, 10_000])
@pytest.mark.parametrize("max_length", [64, 32, 7])
def test_windows_are_the_tokenizers_truncated_pair_with_each_slice_of_text_2(scorer, oracle, max_length, stride):
    ours = our_windows(scorer.tokenizer, PAIRS, max_length, stride)
    for (text_1, text_2), got in zip(PAIRS, ours):
        assert got == reference_windows(oracle.tokenizer, text_1, text_2, max_length, stride)


@SETTINGS
@given(pairs=S.pairs, max_length=st.sampled_from([16, 40, 64]), stride=st.sampled_from([None, 3, 50]))
def test_random_pairs_windows_are_the_tokenizers_truncated_pair_with_each_slice_of_text_2(
        scorer, oracle, pairs, max_length, stride):
    for (text_1, text_2), got in zip(pairs, our_windows(scorer.tokenizer, pairs, max_length, stride)):
        assert got == reference_windows(oracle.tokenizer, text_1, text_2, max_length, stride)


def test_windows_follow_the_truncation_side_left(tiny_dir):
    from transformers import AutoTokenizer

    ours = Scorer(tiny_dir, device="cpu")
    ours.tokenizer.tokenizer.truncation_side = "left"
    theirs = AutoTokenizer.from_pretrained(tiny_dir, truncation_side="left")
    for (text_1, text_2), got in zip(PAIRS, our_windows(ours.tokenizer, PAIRS, 40, 9)):
        assert got == reference_windows(theirs, text_1, text_2, 40, 9)
    first = [enc[0] for enc in our_windows(ours.tokenizer, PAIRS, 40)]
    truncated = ours.tokenizer([p[0] for p in PAIRS], [p[1] for p in PAIRS], 40)
    assert [ids for ids, _ in first] == [truncated.pair(i) for i in range(len(PAIRS))]


@given(n=st.integers(0, 300), width=st.integers(0, 80), stride=st.one_of(st.none(), st.integers(1, 100)),
       from_left=st.booleans())
def test_spans_cover_every_token_each_next_window_starting_stride_tokens_on(n, width, stride, from_left):
    windows = spans(n, width, stride, from_left)
    keep = min(n, width)
    assert windows[0] == ((n - keep, n) if from_left else (0, keep)), "the first window is the truncated pair's"
    if width == 0 or n <= width:
        assert len(windows) == 1
        return
    step = min(stride or max(1, width // 2), width)
    starts = [n - b if from_left else a for a, b in windows]
    assert np.all(np.diff(starts) == step), "each next window starts stride tokens on"
    assert all(b - a == width for a, b in windows[:-1]) and 0 < windows[-1][1] - windows[-1][0] <= width
    assert (windows[-1][0] == 0) if from_left else (windows[-1][1] == n), "the last window reaches the far end"
    covered = np.zeros(n, dtype=bool)
    for a, b in windows:
        covered[a:b] = True
    assert covered.all()


# -- the scores -------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["scorer", "scorer32"])
def test_first_equals_truncate_bit_for_bit_on_long_and_short_documents(request, which):
    s = request.getfixturevalue(which)
    assert np.array_equal(s.predict(PAIRS, long_documents="first"), s.predict(PAIRS))


def test_a_document_that_fits_scores_the_same_in_every_mode(scorer):
    fits = [("q " + word, "a short document about " + word) for word in S.WORDS[:5]] + [("", ""), ("q", "")]
    want = scorer.predict(fits)
    for mode in ("max", "mean", "first"):
        assert np.array_equal(scorer.predict(fits, long_documents=mode, window_stride=1), want), mode


@pytest.mark.slow
@pytest.mark.parametrize("stride", [None, 5])
@pytest.mark.parametrize("which", ["scorer", "scorer32"])
def test_max_and_mean_are_those_of_the_windows_scored_by_transformers(request, oracle, which, stride):
    s = request.getfixturevalue(which)
    got = {mode: s.predict(PAIRS, long_documents=mode, window_stride=stride) for mode in ("max", "mean")}
    for i, (text_1, text_2) in enumerate(PAIRS):
        want = reference_scores(oracle, reference_windows(oracle.tokenizer, text_1, text_2, s.max_length, stride))
        assert got["max"][i] == pytest.approx(want.max(), abs=1e-5), i
        assert got["mean"][i] == pytest.approx(want.mean(), abs=1e-5), i
    assert (got["max"] > got["mean"]).any(), "the long documents' windows differ"


def first_window_logits(s, pairs, stride=None) -> torch.Tensor:
    logits, owner = s._rows(pairs, None, False, None, None, windows=True, stride=stride)
    return logits[np.concatenate([[True], owner[1:] != owner[:-1]])]


def test_the_first_windows_score_bit_for_bit_as_the_truncated_pairs_among_many_windows(scorer):
    pairs = PAIRS * 8  # past 16 sequences a batch: a pair's score may depend on the batch's size by a rounding
    assert torch.equal(first_window_logits(scorer, pairs, 3), scorer.logits(pairs))


@pytest.mark.slow
@SETTINGS
@given(pairs=S.mixed_pairs, stride=st.sampled_from([None, 4, 40]))
def test_max_is_never_below_truncate_the_first_windows_scoring_as_the_truncated_pairs(scorer, pairs, stride):
    truncated = scorer.predict(pairs)
    assert (scorer.predict(pairs, long_documents="max", window_stride=stride) >= truncated).all()
    assert torch.equal(first_window_logits(scorer, pairs, stride), scorer.logits(pairs))


@pytest.mark.slow
def test_windows_of_pairs_split_across_the_engines_input_blocks_keep_their_pairs(scorer, monkeypatch):
    want = {mode: scorer.predict(PAIRS * 3, long_documents=mode) for mode in ("max", "mean")}
    monkeypatch.setattr(engine, "INPUT_BLOCK", 2)  # pairs tokenized two at a time: the rows' pairs offset per block
    for mode, scores in want.items():
        assert np.array_equal(scorer.predict(PAIRS * 3, long_documents=mode), scores), mode


def test_an_iterator_of_pairs_is_windowed_block_by_block_keeping_its_pairs(scorer, monkeypatch):
    import xenc_lab.scorer as scorer_module

    want = {mode: scorer.predict(PAIRS * 3, long_documents=mode) for mode in ("max", "mean")}
    monkeypatch.setattr(scorer_module, "STREAM_BLOCK", 4)  # an iterator taken 4 pairs at a time
    truncated = scorer.predict(iter(PAIRS * 3))
    for mode, scores in want.items():
        got = scorer.predict(iter(PAIRS * 3), long_documents=mode)
        np.testing.assert_allclose(got, scores, rtol=0, atol=1e-6)  # other batches: a rounding apart at most
        assert mode == "mean" or (got >= truncated).all()


def test_the_progress_bar_counts_pairs_not_windows(scorer, capsys):
    scorer.predict(PAIRS, long_documents="max", show_progress_bar=True)
    err = capsys.readouterr().err
    assert f"{len(PAIRS)}/{len(PAIRS)}" in err and "Scoring pairs" in err, err


def test_aggregate_takes_each_pairs_max_mean_and_first_window():
    scores, owner = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.7, 0.2]), np.array([0, 0, 0, 1, 2, 2])
    assert aggregate(scores, owner, 3, "max").tolist() == pytest.approx([0.9, 0.3, 0.7])
    assert aggregate(scores, owner, 3, "mean").tolist() == pytest.approx([0.5, 0.3, 0.45])


# -- options per Scorer and per call ----------------------------------------------------------------
@pytest.mark.slow
def test_the_scorers_mode_and_stride_are_the_default_and_a_call_overrides_them(tiny_dir, scorer):
    long = Scorer(tiny_dir, device="cpu", long_documents="max", window_stride=5)
    assert (long.config.long_documents, long.config.window_stride) == ("max", 5)
    assert np.array_equal(long.predict(PAIRS), scorer.predict(PAIRS, long_documents="max", window_stride=5))
    assert np.array_equal(long.predict(PAIRS, long_documents="truncate"), scorer.predict(PAIRS))
    assert np.array_equal(long.predict(PAIRS, window_stride=20), scorer.predict(PAIRS, long_documents="max",
                                                                                window_stride=20))
    assert not np.array_equal(long.predict(PAIRS), long.predict(PAIRS, window_stride=20)), "the stride matters"


def test_rank_and_score_pass_long_documents_through(scorer):
    docs = [p[1] for p in PAIRS]
    for mode in ("max", "mean"):
        want = scorer.predict([("a query about rivers", d) for d in docs], long_documents=mode, window_stride=9)
        got = scorer.score("a query about rivers", docs, long_documents=mode, window_stride=9)
        assert np.array_equal(got, want)
        ranked = scorer.rank("a query about rivers", docs, long_documents=mode, window_stride=9)
        assert [r["score"] for r in sorted(ranked, key=lambda r: r["corpus_id"])] == pytest.approx(want.tolist())
    assert scorer.score("q", LONG, long_documents="max") >= scorer.score("q", LONG)


@pytest.mark.parametrize("bad", ["maxp", "MAX", "", "truncated"])
def test_an_unknown_mode_is_refused_listing_the_modes(tiny_dir, scorer, bad):
    listing = "'truncate', 'max', 'mean', 'first'"
    with pytest.raises(ValueError, match=f"long_documents must be one of {listing}, got {bad!r}"):
        scorer.predict(PAIRS, long_documents=bad)
    with pytest.raises(ValueError, match=listing):
        Scorer(tiny_dir, device="cpu", long_documents=bad)
    with pytest.raises(ValueError, match=listing):
        scorer.rank("q", ["d"], long_documents=bad)


@pytest.mark.parametrize(("bad", "error"), [(0, ValueError), (-3, ValueError), (1.5, TypeError), ("2", TypeError),
                                            (True, TypeError)])
def test_a_bad_window_stride_is_refused(tiny_dir, scorer, bad, error):
    with pytest.raises(error, match="window_stride must be an int >= 1 or None"):
        scorer.predict(PAIRS, long_documents="max", window_stride=bad)
    with pytest.raises(error, match="window_stride"):
        Scorer(tiny_dir, device="cpu", window_stride=bad)
    with pytest.raises(TypeError, match="long_documents must be one of"):
        scorer.predict(PAIRS, long_documents=1)
    assert scorer.predict(PAIRS, long_documents="max", window_stride=np.int64(3)).shape == (len(PAIRS),)


def test_a_multi_label_model_refuses_max_and_mean_saying_why_and_takes_first(tiny3_dir, scorer3):
    for mode in ("max", "mean"):
        with pytest.raises(ValueError, match=f"long_documents={mode!r} needs a one-label model.*3 labels"):
            scorer3.predict(PAIRS, long_documents=mode)
    with pytest.raises(ValueError, match="one-label model"):
        Scorer(tiny3_dir, device="cpu", long_documents="max")
    assert np.array_equal(scorer3.predict(PAIRS, long_documents="first"), scorer3.predict(PAIRS))


def test_a_tokenizer_without_a_fixed_pair_layout_refuses_windows(tiny_dir):
    s = Scorer(tiny_dir, device="cpu")
    s.tokenizer.layout = None  # as a tokenizer whose post-processor is no fixed template: it truncates pairs itself
    with pytest.raises(ValueError, match="pair layout is not a fixed template"):
        s.predict(PAIRS, long_documents="max")
    assert s.predict(PAIRS).shape == (len(PAIRS),)


# -- decoders: windows inside the chat template -----------------------------------------------------
DECODER_MAX = 160  # qwen3-reranker's template and a short query take about 100 tokens: windows of about 45
DECODER_PAIRS = [("what is a river", " ".join(S.WORDS)), ("q", "a short document"), ("", LONG),
                 ("a long query " * 40, LONG)]  # the last one's query fills the row: one window


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from xenc_lab.zoo.decoders import build_decoder

    return build_decoder("qwen3-reranker", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def decoder(qwen3):
    return Scorer(qwen3, device="cpu", max_length=DECODER_MAX)


def st_rows(path, pairs, max_length, prompt=None) -> list[list[int]]:
    """sentence-transformers' token ids of the pairs (its preprocess, pads dropped)."""
    from sentence_transformers import CrossEncoder

    features = CrossEncoder(str(path), device="cpu", max_length=max_length).preprocess([list(p) for p in pairs],
                                                                                       prompt=prompt)
    return [row[m].tolist() for row, m in zip(features["input_ids"], features["attention_mask"].bool())]


def decoder_windows(decoder, pairs, prompt=None) -> list[list[list[int]]]:
    enc = windowed_pairs(decoder.tokenizer, [p[0] for p in pairs], [p[1] for p in pairs], stride=None, prompt=prompt)
    per_pair = [[] for _ in pairs]
    for row, pair in enumerate(enc.owner):
        per_pair[pair].append(enc.pair(row))
    return per_pair


@pytest.mark.parametrize("prompt", [None, "Judge strictly"])
def test_a_decoders_first_window_is_sentence_transformers_truncated_row(qwen3, decoder, prompt):
    firsts = [rows[0] for rows in decoder_windows(decoder, DECODER_PAIRS, prompt)]
    assert firsts == st_rows(qwen3, DECODER_PAIRS, DECODER_MAX, prompt)


def test_a_decoders_windows_keep_the_template_around_slices_of_the_document_covering_it(qwen3, decoder):
    full = st_rows(qwen3, DECODER_PAIRS[:1], 10_000)[0]  # the whole render
    rows = decoder_windows(decoder, DECODER_PAIRS)[0]
    suffix = decoder.tokenizer.suffix(None)
    start = next(i for i, (a, b) in enumerate(zip(rows[0], rows[1])) if a != b)  # where the document's ids begin
    width = DECODER_MAX - len(suffix) - start
    assert len(rows) >= 3 and width > 10 and full[-len(suffix) :] == suffix
    for j, row in enumerate(rows):
        assert len(row) <= DECODER_MAX and row[:start] == full[:start] and row[-len(suffix) :] == suffix
        at = start + j * (width // 2)  # each window half a window on
        assert row[start : -len(suffix)] == full[at : at + width][: len(full) - len(suffix) - at], j
    assert at + width >= len(full) - len(suffix), "the last window reaches the document's end"
    assert len(decoder_windows(decoder, DECODER_PAIRS)[3]) == 1, "a query that fills the row leaves one window"


@pytest.mark.slow
def test_a_decoders_modes_first_equals_truncate_and_max_and_mean_are_those_of_transformers(qwen3, decoder):
    from transformers import AutoModelForCausalLM

    from xenc_lab.decoder.chat import score_tokens

    truncated = decoder.predict(DECODER_PAIRS)
    got = {mode: decoder.predict(DECODER_PAIRS, long_documents=mode) for mode in ("first", "max", "mean")}
    assert np.array_equal(got["first"], truncated)
    assert torch.equal(first_window_logits(decoder, DECODER_PAIRS * 5), decoder.logits(DECODER_PAIRS * 5))
    fits = DECODER_PAIRS[1:2] * 3
    assert np.array_equal(decoder.predict(fits, long_documents="max"), decoder.predict(fits))
    model = AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).eval()
    yes, no = score_tokens(decoder.tokenizer.tokenizer, decoder.save)
    for i, rows in enumerate(decoder_windows(decoder, DECODER_PAIRS)):
        with torch.no_grad():
            last = torch.stack([model(input_ids=torch.tensor([row])).logits[0, -1] for row in rows])
        want = decoder.activation_fn(last[:, yes] - last[:, no]).numpy()
        assert got["max"][i] == pytest.approx(want.max(), abs=1e-4) and got["max"][i] >= truncated[i]
        assert got["mean"][i] == pytest.approx(want.mean(), abs=1e-4)
    assert (got["max"] > truncated + 1e-3).any(), "a later window scores higher somewhere"


def test_a_decoder_that_truncates_on_the_left_refuses_windows(qwen3):
    s = Scorer(qwen3, device="cpu", max_length=DECODER_MAX)
    s.tokenizer.tokenizer.truncation_side = "left"  # which cuts the template's start and the query first
    with pytest.raises(ValueError, match="truncation_side='left'"):
        s.predict(DECODER_PAIRS, long_documents="max")
    assert np.array_equal(s.predict(DECODER_PAIRS, long_documents="first"), s.predict(DECODER_PAIRS))
