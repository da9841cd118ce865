"""The decoders' paged KV cache, prefix tree and chunk attention, against plain references."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from xenc_lab.decoder.chunks import Chunk, pack_chunks
from xenc_lab.decoder.kv_cache import KVCache, PageAllocator
from xenc_lab.ops.paged_attention import chunk_attention
from xenc_lab.decoder.prefix import no_sharing, prefix_tree, split_long
from xenc_lab.tokenize import Encodings


def encodings(seqs: list[list[int]]) -> Encodings:
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum([len(s) for s in seqs], out=offsets[1:])
    return Encodings(np.array([t for s in seqs for t in s], dtype=np.int64), None, offsets)


# Pairs built as a few shared heads (instruction, query) followed by own tails, with duplicates and prefixes of each
# other, over a small alphabet so that chance overlaps occur too.
_heads = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=30), min_size=1, max_size=3)
_seqs = _heads.flatmap(lambda heads: st.lists(
    st.tuples(st.sampled_from(heads), st.lists(st.integers(0, 3), min_size=0, max_size=12)).map(
        lambda ht: ht[0] + ht[1]).filter(len), min_size=1, max_size=24))


def _check_tree(nodes, seqs, min_shared):
    leaves = [n for n in nodes if n.pair >= 0]
    assert sorted(n.pair for n in leaves) == list(range(len(seqs)))  # every pair once
    below = {i: 0 for i, n in enumerate(nodes) if n.pair < 0}
    for i, node in enumerate(nodes):
        assert node.length >= 1
        assert node.parent < i  # parents first
        if node.parent >= 0:
            assert nodes[node.parent].stop == node.start and nodes[node.parent].level == node.level - 1
        else:
            assert node.start == 0 and node.level == 0
    for leaf in leaves:  # a pair's ids are its ancestors' tokens and its own, end to end
        tokens, i = [], nodes.index(leaf)
        while i >= 0:
            n = nodes[i]
            tokens[:0] = seqs[n.seq][n.start : n.stop]
            if n.pair < 0:
                below[i] += 1
            i = n.parent
        assert tokens == seqs[leaf.pair]
    return below


@settings(max_examples=150, deadline=None)
@given(_seqs, st.integers(1, 8))
def test_prefix_tree_covers_every_pair_once_and_shares_only_common_runs(seqs, min_shared):
    nodes = prefix_tree(encodings(seqs), min_shared)
    below = _check_tree(nodes, seqs, min_shared)
    for i, count in below.items():
        assert count >= 2 and nodes[i].length >= min_shared  # shared by two pairs or more, never too short
    computed = sum(n.length for n in nodes)
    assert computed <= sum(map(len, seqs))


@settings(max_examples=80, deadline=None)
@given(_seqs, st.integers(1, 7))
def test_split_long_chains_keep_every_pair_and_fit_the_limit(seqs, limit):
    nodes = split_long(prefix_tree(encodings(seqs), 4), limit)
    _check_tree(nodes, seqs, 1)
    assert all(n.length <= limit for n in nodes)


def test_a_one_to_many_rerank_shares_the_query_prefix_once():
    head = list(range(40))
    seqs = [head + [100 + d, 7, 200 + d] for d in range(10)]
    nodes = prefix_tree(encodings(seqs), 16)
    assert [(n.start, n.stop, n.pair) for n in nodes if n.pair < 0] == [(0, 40, -1)]
    assert sum(n.length for n in nodes) == 40 + 10 * 3
    assert sum(n.length for n in no_sharing(encodings(seqs))) == 43 * 10


def test_page_allocator_frees_a_page_when_its_last_table_lets_go():
    alloc = PageAllocator(4)
    a = alloc.allocate(2)
    alloc.share(a)  # a second table holds them
    alloc.release(a)
    assert alloc.used == 2
    alloc.release(a)
    assert alloc.used == 0 and sorted(alloc.free) == [0, 1, 2, 3]
    with pytest.raises(MemoryError):
        alloc.allocate(5)
    alloc.grow(6)
    assert len(alloc.allocate(5)) == 5


def test_kv_cache_grows_and_keeps_what_it_holds():
    cache = KVCache(2, 2, 4, 4, torch.float32, torch.device("cpu"))
    cache.reserve(1)
    page = cache.allocator.allocate(1)
    slots = torch.from_numpy(cache.slots_of(page, 3))
    cache.k[:, slots] = 1.5
    cache.reserve(5)
    assert cache.allocator.pages >= 6 and cache.slots == cache.allocator.pages * 4
    assert bool((cache.k[:, slots] == 1.5).all())


H, KVH, D = 4, 2, 8
_TABLE = torch.randn(500, 5, H + 2 * KVH, D, generator=torch.Generator().manual_seed(0))


def _qkv(tokens, positions):
    # q, k, v that depend on the token and its position only, as a model's would
    x = _TABLE[torch.as_tensor(tokens), torch.as_tensor(positions) % 5]
    return x[:, :H], x[:, H : H + KVH], x[:, H + KVH :]


def _reference(seq):
    q, k, v = _qkv(seq, list(range(len(seq))))
    t = lambda x: x.transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(t(q), t(k).repeat_interleave(H // KVH, 1), t(v).repeat_interleave(H // KVH, 1),
                                         is_causal=True, scale=0.3)
    return out[0].transpose(0, 1).reshape(len(seq), H * D)


def _attend(chunks, cache, positions):
    batch = pack_chunks(chunks, 4, cache_slots=cache.slots if cache is not None else 0)
    tokens = np.concatenate([c.tokens for c in chunks])
    q, k, v = _qkv(tokens, positions)
    pad = lambda x: torch.cat([x, x.new_zeros(batch.input_ids.shape[0] - len(x), *x.shape[1:])])
    return chunk_attention(pad(q), pad(k), pad(v), batch, cache, 0, 0.3)[: len(tokens)]


@pytest.mark.parametrize("prefix", [1, 9, 12])
def test_chunks_over_a_cached_prefix_equal_whole_sequence_causal_attention(prefix):
    seqs = [list(range(prefix)) + list(range(100, 100 + n)) for n in (5, 9, 1, 14)]
    cache = KVCache(1, KVH, D, 4, torch.float32, torch.device("cpu"))
    cache.reserve(4)
    pages = cache.allocator.allocate(-(-prefix // 4))
    slots = cache.slots_of(pages, prefix)
    out = _attend([Chunk(seqs[0][:prefix], [], slots)], cache, list(range(prefix)))
    torch.testing.assert_close(out, _reference(seqs[0])[:prefix], rtol=0, atol=1e-6)
    chunks = [Chunk(s[prefix:], slots, None, i) for i, s in enumerate(seqs)]
    out = _attend(chunks, cache, [p for s in seqs for p in range(prefix, len(s))])
    starts = np.cumsum([0] + [len(s) - prefix for s in seqs])
    for i, s in enumerate(seqs):
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], _reference(s)[prefix:], rtol=0, atol=1e-6)
    # A broken context (a slot read twice, another never) changes the result: the test can fail.
    bad = slots.copy()
    bad[0] = bad[-1]
    wrong = [Chunk(s[prefix:], bad, None, i) for i, s in enumerate(seqs)]
    if prefix > 1:
        assert not torch.allclose(_attend(wrong, cache, [p for s in seqs for p in range(prefix, len(s))]), out)


def test_whole_sequences_without_a_cache_equal_causal_attention():
    seqs = [[3, 1, 4, 1, 5], [9, 2, 6], list(range(20, 37))]
    out = _attend([Chunk(s, [], None, i) for i, s in enumerate(seqs)], None, [p for s in seqs for p in range(len(s))])
    starts = np.cumsum([0] + [len(s) for s in seqs])
    for i, s in enumerate(seqs):
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], _reference(s), rtol=0, atol=1e-6)


def _flash_reference(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """torch's varlen_attn as flash attention defines it, on the CPU: per sequence, causal (window (-1, 0)) with the
    queries aligned to the last keys."""
    assert window_size == (-1, 0)
    out = torch.empty_like(q)
    for b in range(len(cu_q) - 1):
        qb, kb, vb = q[cu_q[b] : cu_q[b + 1]], k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]]
        n, m = len(qb), len(kb)
        assert n <= max_q and m <= max_k
        mask = torch.arange(m)[None, :] <= (m - n + torch.arange(n))[:, None]
        t = lambda x: x.transpose(0, 1)
        out[cu_q[b] : cu_q[b + 1]] = t(F.scaled_dot_product_attention(t(qb), t(kb), t(vb), attn_mask=mask, scale=scale,
                                                                       enable_gqa=enable_gqa))
    return out


@pytest.mark.parametrize("path", ["flash", "kernel"])
@pytest.mark.parametrize("last", [False, True])
def test_the_varlen_layout_gives_the_padded_layouts_attention(monkeypatch, last, path):
    """The packed layout on its two paths: CUDA's (flash varlen over each chunk's gathered keys, the kernel
    emulated) and the CPU's (xenc_lab's kernel reading the keys in place): the padded layout's outputs."""
    from xenc_lab.cpu import native
    from xenc_lab.ops import paged_attention
    from xenc_lab.ops.paged_attention import last_token_attention

    if path == "flash":
        monkeypatch.setattr(paged_attention, "varlen_attn", _flash_reference)
    elif not native.available():
        pytest.skip("the native kernels could not be built here")
    else:
        monkeypatch.setattr(paged_attention, "varlen_attn", None)  # the flash path cannot have run
    prefix = 10
    seqs = [list(range(prefix)) + list(range(100, 100 + n)) for n in (5, 9, 1, 14)]
    cache = KVCache(1, KVH, D, 4, torch.float32, torch.device("cpu"))
    cache.reserve(4)
    slots = cache.slots_of(cache.allocator.allocate(3), prefix)
    _attend([Chunk(seqs[0][:prefix], [], slots)], cache, list(range(prefix)))
    chunks = [Chunk(s[prefix:], slots, None, i) for i, s in enumerate(seqs)] + [Chunk([3, 1, 4], [], None, 4)]
    positions = [p for s in seqs for p in range(prefix, len(s))] + [0, 1, 2]
    tokens = np.concatenate([c.tokens for c in chunks])
    outs = {}
    for layout in ("padded", "varlen"):
        batch = pack_chunks(chunks, 4, cache_slots=cache.slots, layout=layout)
        q, k, v = _qkv(tokens, positions)
        pad = lambda x, t=batch.input_ids.shape[0]: torch.cat([x, x.new_zeros(t - len(x), *x.shape[1:])])
        attend = last_token_attention if last else chunk_attention
        attention = "sdpa" if layout == "padded" else "varlen" if path == "flash" else "kernel"  # Choices.attention
        outs[layout] = attend(pad(q), pad(k), pad(v), batch, cache, 0, 0.3, attention)
    rows = len(chunks) if last else len(tokens)
    torch.testing.assert_close(outs["varlen"][:rows], outs["padded"][:rows], rtol=0, atol=1e-6)
    if not last:
        torch.testing.assert_close(outs["varlen"][: len(seqs[0]) - prefix], _reference(seqs[0])[prefix:], rtol=0,
                                   atol=1e-6)
