"""packed_attention == plain SDPA run on each pair alone: attention never crosses a pair boundary."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xenc_lab import kernels
from xenc_lab.batch import pack
from xenc_lab.cpuinfo import CpuInfo
from xenc_lab.layers import (
    PrepackedLinear,
    first_token_attention,
    first_token_kv,
    first_token_self_attention,
    folded_first_token_attention,
    linear_plus,
    onednn_bf16,
    packed_attention,
    prepack_linears,
    split_first,
)
from xenc_lab.tokenize import Encodings

from .test_batch import encodings

# The attention_path fixture patches once per test, not per example: that is what it means to do.
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


@pytest.fixture(autouse=True, params=["kernel", "sdpa", "varlen"])
def attention_path(request, monkeypatch):
    """Every test runs on the CPU kernel, on the SDPA fallback (what runs where it cannot be built), and through
    the CUDA path's varlen glue with a CPU stand-in for flash attention's varlen kernel."""
    if request.param == "kernel" and not kernels._available():
        pytest.skip("the CPU attention kernel could not be built here")
    if request.param in ("sdpa", "varlen"):
        monkeypatch.setattr("xenc_lab.layers.packed_attention_cpu", lambda *args, **kwargs: None)
    if request.param == "varlen":
        monkeypatch.setattr("xenc_lab.layers._varlen_attn", varlen_attn_on_the_cpu)
        monkeypatch.setattr("xenc_lab.layers._VARLEN_TAKES_SCALE", True)
        monkeypatch.setattr("xenc_lab.layers._VARLEN_TAKES_WINDOW", True)
        monkeypatch.setattr("xenc_lab.layers._use_varlen", lambda x, window, scale, head_dim: True)
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
def test_packed_attention_equals_sdpa_on_each_pair_alone(case):
    enc, pairs, page_size, num_heads, head_dim, scale, seed = case
    batch = pack(enc, pairs, page_size)
    d = num_heads * head_dim
    T = batch.input_ids.shape[0]
    qkv = torch.randn(T, 3 * d, generator=torch.Generator().manual_seed(seed)) * 2
    out = packed_attention(qkv, batch, num_heads, scale=scale)
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
def test_packed_attention_of_a_pair_ignores_every_other_pair_and_the_filler(case, data):
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
    a = packed_attention(qkv, batch, num_heads, scale=scale)[s:e]
    b = packed_attention(other, batch, num_heads, scale=scale)[s:e]
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_packed_attention_of_a_single_token_pair_returns_its_own_value():
    enc = Encodings(np.arange(1, 6, dtype=np.int64), None, np.array([0, 4, 5], dtype=np.int64))
    batch = pack(enc, np.array([0, 1]), page_size=4)
    d = 4
    qkv = torch.randn(batch.input_ids.shape[0], 3 * d)
    out = packed_attention(qkv, batch, num_heads=2)
    torch.testing.assert_close(out[4], qkv[4, 2 * d :])  # softmax over one key is 1: output = v


@FAST
@given(attention_cases(), st.integers(0, 12))
def test_packed_attention_with_a_window_equals_banded_sdpa_on_each_pair_alone(case, window):
    enc, pairs, page_size, num_heads, head_dim, scale, seed = case
    batch = pack(enc, pairs, page_size)
    d = num_heads * head_dim
    qkv = torch.randn(batch.input_ids.shape[0], 3 * d, generator=torch.Generator().manual_seed(seed))
    out = packed_attention(qkv, batch, num_heads, scale=scale, window=window)
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
def test_first_token_attention_equals_the_first_row_of_packed_attention(case, window):
    enc, pairs, page_size, num_heads, head_dim, scale, seed = case
    batch = pack(enc, pairs, page_size)
    d = num_heads * head_dim
    qkv = torch.randn(batch.input_ids.shape[0], 3 * d, generator=torch.Generator().manual_seed(seed)) * 2
    full = packed_attention(qkv, batch, num_heads, scale=scale, window=window)
    first = first_token_attention(qkv[batch.first_index, :d], qkv[:, d:], batch, num_heads, scale=scale, window=window)
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
    float32 rounding; anything but the two choices is refused."""
    from xenc_lab import layers

    enc = Encodings(np.arange(1, 40, dtype=np.int64), None, np.array([0, 5, 17, 39]))
    batch = pack(enc, np.array([2, 0, 1]), page_size=8)
    d, num_heads = 16, 4
    proj = torch.nn.Linear(d, 3 * d)
    x = torch.randn(batch.input_ids.shape[0], d)
    taken = []

    def recorded(name):
        op = getattr(layers, name)
        return lambda *args, **kwargs: taken.append(name) or op(*args, **kwargs)

    for name in ("first_token_attention", "folded_first_token_attention"):
        monkeypatch.setattr(layers, name, recorded(name))
    assert first_token_kv() == "folded"
    with torch.no_grad():
        folded = first_token_self_attention(proj, x, batch, num_heads)
        assert taken == ["folded_first_token_attention"]
        monkeypatch.setenv("XENC_LAB_FIRST_TOKEN_KV", "projected")
        projected = first_token_self_attention(proj, x, batch, num_heads)
        assert taken[1:] == ["first_token_attention"]
        torch.testing.assert_close(folded[:3], projected[:3], atol=1e-5, rtol=1e-5)
        monkeypatch.setenv("XENC_LAB_FIRST_TOKEN_KV", "folded")
        first_token_self_attention(proj.bfloat16(), x.bfloat16(), batch, num_heads)  # other dtypes project
        assert taken[2:] == ["first_token_attention"]
    monkeypatch.setenv("XENC_LAB_FIRST_TOKEN_KV", "fold")
    with pytest.raises(ValueError, match="XENC_LAB_FIRST_TOKEN_KV must be one of folded, projected, got 'fold'"):
        first_token_kv()


@pytest.mark.skipif(not kernels.load(), reason="the native kernels could not be built here")
def test_folded_pooling_in_the_kernel_equals_the_loop_and_each_pair_stands_alone(monkeypatch):
    """The kernel's per-pair pooling (pairs shared among threads) equals the Python loop it replaces where the
    kernel is missing, and a pair's result is bitwise the same alone, among other pairs and on any thread count."""
    from xenc_lab import layers

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
    monkeypatch.setattr(layers, "folded_pool_cpu", lambda *a: None)
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


needs_onednn_bf16 = pytest.mark.skipif(not onednn_bf16(), reason="needs oneDNN bfloat16 on this CPU")


@needs_onednn_bf16
@pytest.mark.parametrize("bias", [True, False])
def test_prepacked_linear_equals_linear_to_the_bit_and_so_do_its_row_slices(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 3 * 16, bias=bias).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(37, 48, dtype=torch.bfloat16)
    packed = PrepackedLinear(linear, gemm="native")
    assert torch.equal(packed(x), linear(x))
    want = torch.nn.functional.linear(x, linear.weight[16:], None if linear.bias is None else linear.bias[16:])
    assert torch.equal(packed.rows(16, 48)(x), want)
    assert packed.rows(16, 48) is packed.rows(16, 48)  # packed once


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepack_linears_replaces_every_linear_and_keeps_its_products(dtype, monkeypatch):
    if not PrepackedLinear.supported(dtype, torch.device("cpu")):
        pytest.skip(f"no oneDNN {dtype} GEMM on this CPU")
    monkeypatch.setenv("XENC_LAB_BF16_GEMM", "native")  # bf16: the same products (the fp16 GEMM: test_half_gemm)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model = model.to(dtype).requires_grad_(False)
    x = torch.randn(16, 4, dtype=dtype)
    want = model(x)
    assert prepack_linears(model) == 2 and isinstance(model[0], PrepackedLinear)
    torch.testing.assert_close(model(x), want, atol=1e-6, rtol=1e-6)  # float32: rounding may differ from MKL's
    assert prepack_linears(model) == 0  # nothing left to prepack


def test_prepack_linears_keeps_the_linears_it_is_told_to():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    kept = model[1]
    assert prepack_linears(model, keep=[kept]) == 1
    assert isinstance(model[0], PrepackedLinear) and model[1] is kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_first_takes_the_query_rows_from_torch_in_float32(dtype, monkeypatch):
    """One row per pair: in float32 torch's F.linear (the oracle's rounding) even from a prepacked projection; in
    bfloat16 the prepacked GEMM."""
    proj = onednn_linear(dtype, 8, 3 * 8)
    monkeypatch.setenv("XENC_LAB_BF16_GEMM", "native")
    packed = PrepackedLinear(proj)
    enc, pairs = Encodings(np.arange(1, 10, dtype=np.int64), None, np.array([0, 4, 9])), np.array([1, 0])
    batch = pack(enc, pairs, page_size=4)
    x = torch.randn(batch.input_ids.shape[0], 8).to(dtype)
    q, kv = split_first(packed, x, batch)
    first = x[batch.first_index]
    torch_q = torch.nn.functional.linear(first, proj.weight[:8], proj.bias[:8])
    assert torch.equal(q, torch_q if dtype == torch.float32 else packed.rows(0, 8)(first))
    assert torch.equal(kv, packed.rows(8, 24)(x))


def onednn_linear(dtype: torch.dtype, in_features: int, out_features: int) -> torch.nn.Linear:
    """A seeded Linear in ``dtype``; skips the test where oneDNN has no GEMM of that dtype here."""
    if not PrepackedLinear.supported(dtype, torch.device("cpu")):
        pytest.skip(f"no oneDNN {dtype} GEMM on this CPU")
    torch.manual_seed(0)
    return torch.nn.Linear(in_features, out_features).to(dtype).requires_grad_(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_linear_with_fused_gelu_equals_linear_then_exact_gelu(dtype):
    linear = onednn_linear(dtype, 32, 64)
    x = torch.randn(20, 32, dtype=dtype) * 3
    want = torch.nn.functional.gelu(linear(x).float())
    got = PrepackedLinear(linear, gemm="native")(x, activation="gelu").float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16: the fused GELU rounds once, the reference twice
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_linear_adds_a_residual_inside_the_gemm(dtype):
    linear = onednn_linear(dtype, 96, 64)
    x, residual = torch.randn(40, 96, dtype=dtype), torch.randn(40, 64, dtype=dtype) * 4
    packed = PrepackedLinear(linear, gemm="native")
    got = linear_plus(packed, x, residual)
    if dtype == torch.float32:  # the same two float32 roundings as the GEMM, then the add
        assert torch.equal(got, packed(x) + residual)
    else:  # rounded once to bfloat16: no further from the exact sum than the GEMM-then-add's two roundings
        exact = x.double() @ linear.weight.double().T + linear.bias.double() + residual.double()
        assert (got.double() - exact).abs().max() <= (linear(x) + residual).double().sub(exact).abs().max()
    assert torch.equal(linear_plus(linear, x, residual), linear(x) + residual)  # not prepacked: the plain sum
    with pytest.raises(ValueError, match="residual"):
        packed(x, activation="gelu", residual=residual)


def test_bf16_gemm_is_read_from_the_cpu_or_the_environment(monkeypatch):
    from xenc_lab.layers import bf16_gemm

    for choice in ("native", "fp32", "fp16"):
        monkeypatch.setenv("XENC_LAB_BF16_GEMM", choice.upper())
        assert bf16_gemm() == choice
    monkeypatch.setenv("XENC_LAB_BF16_GEMM", "fast")
    with pytest.raises(ValueError, match="XENC_LAB_BF16_GEMM must be one of native, fp32, fp16, got 'fast'"):
        bf16_gemm()
    monkeypatch.delenv("XENC_LAB_BF16_GEMM")
    monkeypatch.setattr("xenc_lab.layers.onednn_bf16", lambda: False)  # AVX2-only CPUs, whoever made them
    for vendor in ("GenuineIntel", "AuthenticAMD"):
        monkeypatch.setattr("xenc_lab.layers.cpu_info", lambda v=vendor: CpuInfo(v, "cpu", frozenset({"avx2"})))
        assert bf16_gemm() == "fp32"
    monkeypatch.setattr("xenc_lab.layers.onednn_bf16", lambda: True)
    monkeypatch.setattr("xenc_lab.layers.cpu_info", lambda: CpuInfo("GenuineIntel", "Xeon", frozenset({"avx512_bf16"})))
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    for half in (True, False):  # Intel without AMX: the fp16 GEMM where it runs, else fp32 products
        monkeypatch.setattr("xenc_lab.layers.half_gemm_available", lambda h=half: h)
        assert bf16_gemm() == ("fp16" if half else "fp32")
    for vendor, flags in (("GenuineIntel", {"avx512_bf16", "amx_bf16"}), ("AuthenticAMD", {"avx512_bf16"})):
        monkeypatch.setattr("xenc_lab.layers.cpu_info", lambda v=vendor, f=flags: CpuInfo(v, "cpu", frozenset(f)))
        assert bf16_gemm() == "native"


@pytest.mark.parametrize("onednn", [False, True])
def test_bf16_layers_without_onednn_bf16_take_the_fp32_route(monkeypatch, onednn):
    """Where oneDNN has no bf16 GEMM (AVX2-only CPUs), a bf16 layer is still prepacked, on the fp32 route even when
    "native" is asked: exact bf16 products, fp32 sums, one rounding to bf16, the numbers of a bf16 GEMM but for the
    order of the fp32 sums."""
    if onednn and not onednn_bf16():
        pytest.skip("needs oneDNN bfloat16 on this CPU")
    monkeypatch.setattr("xenc_lab.layers.onednn_bf16", lambda: onednn)
    assert PrepackedLinear.supported(torch.bfloat16, torch.device("cpu"))
    torch.manual_seed(0)
    linear = torch.nn.Linear(384, 256).to(torch.bfloat16).requires_grad_(False)
    x, residual = torch.randn(300, 384, dtype=torch.bfloat16), torch.randn(300, 256, dtype=torch.bfloat16)
    layer = PrepackedLinear(linear, gemm="native")
    assert layer.gemm == ("native" if onednn else "fp32") and layer.weight.dtype == torch.bfloat16
    wide = x.double() @ linear.weight.double().T + linear.bias.double()
    for got, exact in ((layer(x), wide), (layer(x, residual=residual), wide + residual.double()),
                       (layer.rows(128, 256)(x), wide[:, 128:])):
        assert got.dtype == torch.bfloat16
        rounded = exact.to(torch.bfloat16)  # the correctly rounded result
        assert (got == rounded).double().mean() > 0.999
        assert ((got.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-4).all()  # a bf16 step, fp32 sums' error


@needs_onednn_bf16
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_products_as_fp32_gemms_give_the_bf16_gemms_numbers(bias):
    """Exact bf16 products, fp32 sums, one rounding: outputs equal to the native bf16 GEMM's but for the order
    of the fp32 sums, which moves a rare element by one bf16 step; weights stay bf16, outputs are bf16."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(384, 256, bias=bias).to(torch.bfloat16).requires_grad_(False)
    x, residual = torch.randn(300, 384, dtype=torch.bfloat16), torch.randn(300, 256, dtype=torch.bfloat16)
    native, wide = PrepackedLinear(linear, gemm="native"), PrepackedLinear(linear, gemm="fp32")
    assert wide.gemm == "fp32" and wide.weight.dtype == torch.bfloat16
    for call in (lambda m: m(x), lambda m: m(x, activation="gelu"), lambda m: m(x, residual=residual),
                 lambda m: m.rows(128, 256)(x)):
        a, b = call(native), call(wide)
        assert b.dtype == torch.bfloat16 and a.shape == b.shape
        assert (a == b).double().mean() > 0.999
        step = a.double().abs().clamp_min(1e-30) * 2**-7  # one bf16 step (8-bit significand)
        assert ((a.double() - b.double()).abs() <= step).all()
    assert wide.rows(128, 256).gemm == "fp32"


def test_fp32_layers_ignore_the_bf16_gemm_and_a_bad_one_is_refused():
    linear = torch.nn.Linear(8, 4).requires_grad_(False)
    assert PrepackedLinear(linear, gemm="fp16").gemm == PrepackedLinear(linear, gemm="fp32").gemm == "native"
    with pytest.raises(ValueError, match="gemm must be None or one of native, fp32, fp16, got 'int8'"):
        PrepackedLinear(linear, gemm="int8")

