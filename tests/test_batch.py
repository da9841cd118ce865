"""Properties of pack(): one planned batch -> one flat token stream of whole pages, and its (B, L) layout."""
from __future__ import annotations

import itertools

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xenc_lab.batch import ATTENTION_ALIGN, MIN_ROWS, pack
from xenc_lab.pages import pages_for
from xenc_lab.tokenize import Encodings

FAST = settings(max_examples=80, deadline=None)
PAD = 0


@st.composite
def encodings(draw, max_pairs: int = 12, max_len: int = 40):
    """Random flat Encodings (ids never equal PAD), a batch of distinct pair indices in any order, a page size."""
    lengths = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_pairs))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 30000, size=total, dtype=np.int64)
    with_types = draw(st.booleans())
    type_ids = rng.integers(0, 2, size=total, dtype=np.int64) if with_types else None
    enc = Encodings(ids, type_ids, offsets)
    batch = draw(st.permutations(range(len(lengths))))
    take = draw(st.integers(1, len(lengths)))
    pairs = np.asarray(batch[:take], dtype=np.int64)
    page_size = draw(st.integers(1, 16))
    return enc, pairs, page_size


def _spans(b):
    cu = b.cu_seqlens.tolist()
    return list(itertools.pairwise(cu))


@FAST
@given(encodings())
def test_pack_lays_each_pairs_ids_contiguously_in_batch_order(case):
    enc, pairs, page_size = case
    b = pack(enc, pairs, page_size, PAD)
    spans = _spans(b)
    assert len(spans) == len(pairs)
    assert spans[0][0] == 0
    for (s, e), p in zip(spans, pairs):
        assert b.input_ids[s:e].tolist() == enc.pair(int(p))
        if enc.type_ids is not None:
            assert b.token_type_ids[s:e].tolist() == enc.type_ids[enc.offsets[p] : enc.offsets[p + 1]].tolist()
    assert (enc.type_ids is None) == (b.token_type_ids is None)
    P, B = len(pairs), max(len(pairs), MIN_ROWS)
    assert b.seq_lens.tolist() == enc.lengths[pairs].tolist() + [1] * (B - P)  # filler sequences: one token
    assert b.num_tokens == int(enc.lengths[pairs].sum()) == spans[-1][1]
    assert b.first_index.tolist() == [s for s, _ in spans] + [0] * (B - P)
    assert b.pairs.tolist() == pairs.tolist()


@FAST
@given(encodings())
def test_pack_stream_is_the_fewest_whole_pages_with_pad_filler(case):
    enc, pairs, page_size = case
    b = pack(enc, pairs, page_size, PAD)
    total = b.input_ids.shape[0]
    assert total % page_size == 0
    assert total == pages_for(b.num_tokens, page_size) * page_size
    assert b.input_ids[b.num_tokens :].eq(PAD).all()
    assert b.positions.shape == (total,)
    if b.token_type_ids is not None:
        assert b.token_type_ids.shape == (total,)
    assert b.max_seqlen % ATTENTION_ALIGN == 0
    # one key slot past the longest pair, so every pair takes the same (masked) attention path
    assert b.max_seqlen == pages_for(int(enc.lengths[pairs].max()) + 1, ATTENTION_ALIGN) * ATTENTION_ALIGN


@FAST
@given(encodings())
def test_pack_positions_restart_at_zero_for_every_pair(case):
    enc, pairs, page_size = case
    b = pack(enc, pairs, page_size, PAD)
    for s, e in _spans(b):
        assert b.positions[s:e].tolist() == list(range(e - s))


@FAST
@given(encodings())
def test_pack_pad_index_with_key_mask_reproduces_each_pairs_tokens(case):
    enc, pairs, page_size = case
    b = pack(enc, pairs, page_size, PAD)
    B, L = max(len(pairs), MIN_ROWS), b.max_seqlen
    assert b.key_mask.shape == (B, 1, 1, L) and b.key_mask.dtype == torch.bool
    assert b.key_mask[len(pairs) :, 0, 0].sum(-1).eq(1).all()  # a filler sequence sees one slot
    padded = b.input_ids[b.pad_index].view(B, L)
    for row, p in enumerate(pairs):
        mask = b.key_mask[row, 0, 0]
        n = int(enc.lengths[p])
        assert mask.tolist() == [True] * n + [False] * (L - n)
        assert padded[row][mask].tolist() == enc.pair(int(p))


@FAST
@given(encodings())
def test_pack_unpad_index_takes_the_padded_layout_back_to_the_stream(case):
    enc, pairs, page_size = case
    b = pack(enc, pairs, page_size, PAD)
    B, L, T = max(len(pairs), MIN_ROWS), b.max_seqlen, b.input_ids.shape[0]
    x = torch.randn(T, 3)  # features, not just ids: every token distinct
    padded = x[b.pad_index].view(B, L, 3)
    back = padded.reshape(B * L, 3)[b.unpad_index]
    assert back.shape == (T, 3)
    assert torch.equal(back[: b.num_tokens], x[: b.num_tokens])


@FAST
@given(encodings())
def test_pack_index_and_length_dtypes_are_the_documented_ones(case):
    enc, pairs, page_size = case
    b = pack(enc, pairs, page_size, PAD)
    assert b.input_ids.dtype == torch.int64
    assert b.positions.dtype == torch.int64
    assert b.cu_seqlens.dtype == torch.int32
    assert b.seq_lens.dtype == torch.int64
    assert b.pad_index.dtype == torch.int64 and b.unpad_index.dtype == torch.int64
    moved = b.to(torch.device("cpu"))
    assert torch.equal(moved.input_ids, b.input_ids) and moved.max_seqlen == b.max_seqlen


def test_pack_fills_the_last_page_with_the_given_pad_token():
    enc = Encodings(np.array([5, 6, 7, 8, 9], dtype=np.int64), None, np.array([0, 3, 5], dtype=np.int64))
    b = pack(enc, np.array([1, 0]), page_size=4, pad_token_id=1)
    assert b.input_ids.tolist() == [8, 9, 5, 6, 7, 1, 1, 1]
    assert b.positions.tolist() == [0, 1, 0, 1, 2, 0, 0, 0]
    assert b.cu_seqlens.tolist() == [0, 2, 5]

