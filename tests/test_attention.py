"""Attention on every path (the CPU kernel, SDPA, the CUDA varlen glue) equals plain SDPA run on each pair alone:
it never crosses a pair boundary. The first-token forms equal the first rows of the full attention."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xenc_lab import choices as engine_choices
from xenc_lab.batch import pack
from xenc_lab.cpu import native
from xenc_lab.ops import first_token
from xenc_lab.ops.attention import first_token_attention, packed_attention
from xenc_lab.ops.first_token import first_token_self_attention, folded_first_token_attention, split_first
from xenc_lab.tokenize import Encodings

from .test_batch import encodings

# The path fixture patches once per test, not per example: that is what it means to do.
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def varlen_attn_on_the_cpu(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """torch's CUDA-only varlen_attn as a CPU stand-in, with what flash attention asks of its inputs. Like the
    kernel, it computes no query row past ``max_q`` in a sequence: those rows come back NaN here. A window
    (left, right) is taken where queries and keys are the same rows, the only case where xenc_lab passes one
    (flash attention aligns a shorter query sequence with the end of the keys)."""
    assert q.dim() == k.dim() == v.dim() == 3 and q.shape[1:] == k.shape[1:] == v.shape[1:], (q.shape, k.shape)
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "the head dimension must be contiguous"
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.shape == cu_k.shape, (cu_q.dtype, cu_q.shape, cu_k.shape)
    assert cu_q[0] == cu_k[0] == 0 and cu_q[-1] == q.shape[0] and cu_k[-1] == k.shape[0], "cu_seqlens must cover the rows"
    assert isinstance(max_q, int) and isinstance(max_k, int)
    left, right = window_size
    if (left, right) != (-1, -1):
        assert torch.equal(cu_q, cu_k) and min(left, right) >= 0, (window_size, cu_q, cu_k)
    out = torch.full_like(q, float("nan"))
    for b in range(cu_q.shape[0] - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if qe == qs:
            continue
        rows = min(qe - qs, max_q)
        if ke == ks:  # no keys: flash attention writes zeros
            out[qs : qs + rows] = 0
            continue
        mask = None
        if (left, right) != (-1, -1):
            i, j = torch.arange(rows)[:, None], torch.arange(ke - ks)[None, :]
            mask = (j >= i - left) & (j <= i + right)
        qh, kh, vh = q[qs : qs + rows].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)
        out[qs : qs + rows] = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale).transpose(0, 1)
    return out


@pytest.fixture(params=["kernel", "sdpa", "varlen"])
def path(request, monkeypatch):
    """Each attention test runs on the CPU kernel, on SDPA (what runs where the kernel cannot be built), and through
    the CUDA path's varlen glue with a CPU stand-in for flash attention's varlen kernel."""
    if request.param == "kernel" and not native.available():
        pytest.skip("the CPU attention kernel could not be built here")
    if request.param == "varlen":
        monkeypatch.setattr("xenc_lab.ops.attention._varlen_attn", varlen_attn_on_the_cpu)
        monkeypatch.setattr("xenc_lab.ops.attention._VARLEN_TAKES_SCALE", True)
        monkeypatch.setattr("xenc_lab.ops.attention._VARLEN_TAKES_WINDOW", True)
    return request.param


def _per_pair_reference(qkv: torch.Tensor, batch, num_heads: int, scale=None) -> list[torch.Tensor]:
    d = qkv.shape[-1] // 3
    out = []
    cu = batch.cu_seqlens.tolist()
    for s, e in itertools.pairwise(cu):
        n = e - s
        q, k, v = (qkv[s:e, i * d : (i + 1) * d].view(n, num_heads, d // num_heads).transpose(0, 1)[None] for i in range(3))
        o = F.scaled_dot_product_attention(q, k, v, scale=scale)  # (1, H, n, dh), no mask: the pair alone
        out.append(o[0].transpose(0, 1).reshape(n, d))
    return out


@st.composite
def attention_cases(draw):
    enc, pairs, page_size = draw(encodings(max_pairs=8, max_len=30))
    num_heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([2, 8]))
    scale = draw(st.none() | st.floats(0.05, 2.0))
    seed = draw(st.integers(0, 2**31 - 1))
    return enc, pairs, page_size, num_heads, head_dim, scale, seed


@FAST
@given(attention_cases())
def test_packed_attention_equals_sdpa_on_each_pair_alone(path, case):
    enc, pairs, page_size, num_heads, head_dim, scale, seed = case
    batch = pack(enc, pairs, page_size)
    d = num_heads * head_dim
    T = batch.input_ids.shape[0]
    qkv = torch.randn(T, 3 * d, generator=torch.Generator().manual_seed(seed)) * 2
    out = packed_attention(qkv, batch, num_heads, path, scale=scale)
    assert out.shape == (T, d)
    cu = batch.cu_seqlens.tolist()
    # float64 reference; float32 rounds each score by about |score| * 2^-24, and exp turns that into a relative
    # error of the weights: the tolerance grows with the largest score and value (large scales make large scores).
    q, k, v = qkv.double().split(d, dim=-1)
    dh = d // num_heads
    for b, ref in enumerate(_per_pair_reference(qkv.double(), batch, num_heads, scale)):
        s, e = cu[b], cu[b + 1]
        heads = [slice(h * dh, (h + 1) * dh) for h in range(num_heads)]
        top = max((q[s:e, c] @ k[s:e, c].T).abs().max().item() for c in heads) * (dh**-0.5 if scale is None else scale)
        atol = 1e-6 + 2**-20 * max(top, 1.0) * v[s:e].abs().max().item()
        torch.testing.assert_close(out[s:e].double(), ref, atol=atol, rtol=1e-5)


@FAST
@given(attention_cases(), st.data())
def test_packed_attention_of_a_pair_ignores_every_other_pair_and_the_filler(path, case, data):
    enc, pairs, page_size, num_heads, head_dim, scale, seed = case
    batch = pack(enc, pairs, page_size)
    d = num_heads * head_dim
    T = batch.input_ids.shape[0]
    qkv = torch.randn(T, 3 * d, generator=torch.Generator().manual_seed(seed))
    keep = data.draw(st.integers(0, len(pairs) - 1), label="pair kept")
    cu = batch.cu_seqlens.tolist()
    s, e = cu[keep], cu[keep + 1]
    other = torch.randn(T, 3 * d, generator=torch.Generator().manual_seed(seed + 1)) * 10
    other[s:e] = qkv[s:e]  # everything but the kept pair changes, filler included
    a = packed_attention(qkv, batch, num_heads, path, scale=scale)[s:e]
    b = packed_attention(other, batch, num_heads, path, scale=scale)[s:e]
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_packed_attention_of_a_single_token_pair_returns_its_own_value(path):
    enc = Encodings(np.arange(1, 6, dtype=np.int64), None, np.array([0, 4, 5], dtype=np.int64))
    batch = pack(enc, np.array([0, 1]), page_size=4)
    d = 4
    qkv = torch.randn(batch.input_ids.shape[0], 3 * d)
    out = packed_attention(qkv, batch, 2, path)
    torch.testing.assert_close(out[4], qkv[4, 2 * d :])  # softmax over one key is 1: output = v


@FAST
@given(attention_cases(), st.integers(0, 12))
def test_packed_attention_with_a_window_equals_banded_sdpa_on_each_pair_alone(path, case, window):
    enc, pairs, page_size, num_heads, head_dim, scale, seed = case
    batch = pack(enc, pairs, page_size)
    d = num_heads * head_dim
    qkv = torch.randn(batch.input_ids.shape[0], 3 * d, generator=torch.Generator().manual_seed(seed))
    out = packed_attention(qkv, batch, num_heads, path, scale=scale, sliding_window=window)
    cu = batch.cu_seqlens.tolist()
    for b, (s, e) in enumerate(itertools.pairwise(cu)):
        n = e - s
        slots = torch.arange(n)
        band = (slots[:, None] - slots[None, :]).abs() <= window // 2
        q, k, v = (qkv[s:e, i * d : (i + 1) * d].view(n, num_heads, head_dim).transpose(0, 1)[None] for i in range(3))
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=scale)[0].transpose(0, 1).reshape(n, d)
        torch.testing.assert_close(out[s:e], ref, atol=1e-5, rtol=1e-5)


@FAST
@given(attention_cases(), st.none() | st.integers(0, 12))
def test_first_token_attention_equals_the_first_row_of_packed_attention(path, case, window):
    enc, pairs, page_size, num_heads, head_dim, scale, seed = case
    batch = pack(enc, pairs, page_size)
    d = num_heads * head_dim
    qkv = torch.randn(batch.input_ids.shape[0], 3 * d, generator=torch.Generator().manual_seed(seed)) * 2
    full = packed_attention(qkv, batch, num_heads, path, scale=scale, sliding_window=window)
    first = first_token_attention(qkv[batch.first_index, :d], qkv[:, d:], batch, num_heads, path, scale=scale,
                                  sliding_window=window)
    P = len(pairs)
    assert first.shape == (batch.seq_lens.shape[0], d)
    torch.testing.assert_close(first[:P], full[batch.first_index[:P]], atol=1e-5, rtol=1e-5)


def test_split_first_projects_queries_at_first_tokens_and_keys_values_everywhere():
    enc, pairs = Encodings(np.arange(1, 10, dtype=np.int64), None, np.array([0, 4, 9])), np.array([1, 0])
    batch = pack(enc, pairs, page_size=4)
    proj = torch.nn.Linear(6, 3 * 6)
    x = torch.randn(batch.input_ids.shape[0], 6)
    q, kv = split_first(proj, x, batch)
    full = proj(x)
    torch.testing.assert_close(q, full[batch.first_index, :6])
    torch.testing.assert_close(kv, full[:, 6:])


def _first_token_reference(x, proj, batch, num_heads):
    """float64 attention of each pair's first token over its projected keys and values, pair by pair (SDPA)."""
    d = x.shape[1]
    q, k, v = proj(x).split(d, dim=-1)
    out = []
    for s, e in itertools.pairwise(batch.cu_seqlens.tolist()):
        if e > s:
            heads = [t.view(-1, num_heads, d // num_heads).transpose(0, 1) for t in (q[s : s + 1], k[s:e], v[s:e])]
            out.append(F.scaled_dot_product_attention(*heads).transpose(0, 1).reshape(d))
    return torch.stack(out)


@FAST
@given(encodings(max_pairs=8, max_len=30), st.sampled_from([1, 2, 4]), st.sampled_from([2, 8]), st.booleans(),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_folded_first_token_attention_equals_attention_over_projected_keys_and_values(
    case, num_heads, head_dim, bias, fixed_shape, seed
):
    """The keys and values folded into the query: in float64 the same numbers as projecting every token, to
    rounding; pairs of every length, filler sequences (empty ones in a fixed compiled shape) and any head count."""
    enc, pairs, page_size = case
    shape = None
    if fixed_shape:
        plain = pack(enc, pairs, page_size)
        shape = (plain.input_ids.shape[0] + 2 * page_size, len(pairs) + 3, plain.max_seqlen + 8)
    batch = pack(enc, pairs, page_size, shape=shape)
    d = num_heads * head_dim
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch.input_ids.shape[0], d, generator=gen, dtype=torch.float64)
    proj = torch.nn.Linear(d, 3 * d, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        proj.weight.copy_(torch.randn(3 * d, d, generator=gen, dtype=torch.float64) * 0.7)
        if bias:
            proj.bias.copy_(torch.randn(3 * d, generator=gen, dtype=torch.float64) * 3)
        q = proj(x[batch.first_index])[:, :d]
        out = folded_first_token_attention(x, q, batch.cu_seqlens, proj.weight[d:], proj.bias[d:] if bias else None, num_heads)
        ref = _first_token_reference(x, proj, batch, num_heads)
    P = len(pairs)
    assert out.shape == (batch.seq_lens.shape[0], d)
    torch.testing.assert_close(out[:P], ref, atol=1e-10, rtol=1e-10)


def test_the_last_layer_folds_its_keys_and_values_on_the_cpu_in_float32(monkeypatch):
    """float32 on the CPU folds (the projected path's ops never run); the projected path, forced, agrees within
    float32 rounding; other dtypes project; anything but the two choices is refused at load."""
    enc = Encodings(np.arange(1, 40, dtype=np.int64), None, np.array([0, 5, 17, 39]))
    batch = pack(enc, np.array([2, 0, 1]), page_size=8)
    d, num_heads = 16, 4
    proj = torch.nn.Linear(d, 3 * d)
    x = torch.randn(batch.input_ids.shape[0], d)
    taken = []

    def recorded(name):
        op = getattr(first_token, name)
        return lambda *args, **kwargs: taken.append(name) or op(*args, **kwargs)

    for name in ("first_token_attention", "folded_first_token_attention"):
        monkeypatch.setattr(first_token, name, recorded(name))
    cpu = torch.device("cpu")
    fp32 = engine_choices.resolve(cpu, torch.float32, (num_heads, d // num_heads), False)
    assert fp32.first_token_kv == "folded"
    with torch.no_grad():
        folded = first_token_self_attention(proj, x, batch, num_heads, fp32)
        assert taken == ["folded_first_token_attention"]
        monkeypatch.setenv("XENC_LAB_FIRST_TOKEN_KV", "projected")
        forced = engine_choices.resolve(cpu, torch.float32, (num_heads, d // num_heads), False)
        projected = first_token_self_attention(proj, x, batch, num_heads, forced)
        assert forced.first_token_kv == "projected" and taken[1:] == ["first_token_attention"]
        torch.testing.assert_close(folded[:3], projected[:3], atol=1e-5, rtol=1e-5)
        monkeypatch.setenv("XENC_LAB_FIRST_TOKEN_KV", "folded")
        bf16 = engine_choices.resolve(cpu, torch.bfloat16, (num_heads, d // num_heads), False)
        assert bf16.first_token_kv == "projected"  # other dtypes project
        first_token_self_attention(proj.bfloat16(), x.bfloat16(), batch, num_heads, bf16)
        assert taken[2:] == ["first_token_attention"]
    monkeypatch.setenv("XENC_LAB_FIRST_TOKEN_KV", "fold")
    with pytest.raises(ValueError, match="XENC_LAB_FIRST_TOKEN_KV must be one of folded, projected, got 'fold'"):
        engine_choices.resolve(cpu, torch.float32, (num_heads, d // num_heads), False)


@pytest.mark.skipif(not native.available(), reason="the native kernels could not be built here")
def test_folded_pooling_in_the_kernel_equals_the_loop_and_each_pair_stands_alone(monkeypatch):
    """The kernel's per-pair pooling (pairs shared among threads) equals the Python loop it replaces where the
    kernel is missing, and a pair's result is bitwise the same alone, among other pairs and on any thread count."""
    lengths = [7, 1, 30, 12, 3]
    enc = Encodings(np.arange(1, sum(lengths) + 1, dtype=np.int64), None, np.cumsum([0, *lengths]))
    batch = pack(enc, np.arange(len(lengths)), page_size=8)
    d, num_heads = 32, 4
    gen = torch.Generator().manual_seed(5)
    x, q = torch.randn(batch.input_ids.shape[0], d, generator=gen), torch.randn(batch.seq_lens.shape[0], d, generator=gen)
    kv_weight, kv_bias = torch.randn(2 * d, d, generator=gen), torch.randn(2 * d, generator=gen)
    args = (x, q, batch.cu_seqlens, kv_weight, kv_bias, num_heads)
    kernel = folded_first_token_attention(*args)
    with torch.inference_mode():  # as the runner calls it: the worker threads write inference tensors too
        assert torch.equal(folded_first_token_attention(*args), kernel)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(folded_first_token_attention(*args), kernel)
    finally:
        torch.set_num_threads(threads)
    for b in range(len(lengths)):  # pair b alone: its rows, its query among filler rows (a batch has 16 or more)
        s, e = batch.cu_seqlens[b : b + 2].tolist()
        q_alone = torch.zeros_like(q)
        q_alone[0] = q[b]
        alone = folded_first_token_attention(x[s:e], q_alone, torch.tensor([0, e - s], dtype=torch.int32), kv_weight, kv_bias, num_heads)
        assert torch.equal(alone[0], kernel[b])
    monkeypatch.setattr(first_token, "folded_pool_cpu", lambda *a: None)
    torch.testing.assert_close(folded_first_token_attention(*args)[: len(lengths)], kernel[: len(lengths)], atol=1e-6, rtol=1e-6)


def test_the_folded_attention_op_passes_opcheck():
    """The opaque op that torch.compile keeps: schema, fake tensor and dynamic shapes agree with the real op."""
    enc = Encodings(np.arange(1, 40, dtype=np.int64), None, np.array([0, 5, 17, 39]))
    batch = pack(enc, np.array([2, 0, 1]), page_size=8)
    d, num_heads = 16, 4
    x, q = torch.randn(batch.input_ids.shape[0], d), torch.randn(batch.seq_lens.shape[0], d)
    kv_weight, kv_bias = torch.randn(2 * d, d), torch.randn(2 * d)
    for bias in (kv_bias, None):
        torch.library.opcheck(folded_first_token_attention, (x, q, batch.cu_seqlens, kv_weight, bias, num_heads))
