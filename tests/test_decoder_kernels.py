"""xenc_lab's decoder kernels on the CPU against their definitions: causal attention of chunks over a paged KV cache
(``paged_attention``), RMSNorm and the q/k norm with rotary positions (``rms_norm``, ``rope``) against transformers'
own modules. Tolerances as in test_kernels: the kernels compute in float32, so float32 outputs match float64 within
float32 rounding and 16-bit outputs are (almost always) the correctly rounded result. ``test_kernels``'s test of the
other CPUs' builds runs these too."""
from __future__ import annotations

import pytest
import torch

from tests.test_kernels import DTYPES, assert_matches, reference
from xenc_lab.cpu import kernels, native


@pytest.fixture(scope="module", autouse=True)
def built():
    if not native.available():
        pytest.skip("the native kernels could not be built here (see the 'xenc_lab' warning)")


def paged_problem(gen, dtype, lengths, contexts, heads, kv_heads, head_dim, cache_rows=60):
    """A stream of chunks (``lengths`` tokens each) over cached contexts (``contexts`` slots each, drawn at random
    from the cache): q from the columns of a fused (T, (H + 2 KVH) D) tensor, as the models' projection gives it."""
    tokens = sum(lengths)
    qkv = torch.randn(tokens + 3, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)  # 3 filler rows
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    k_cache = torch.randn(cache_rows, kv_heads * head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(cache_rows, kv_heads * head_dim, generator=gen).to(dtype)
    index, cu_q, cu_k = [], [0], [0]
    for n, c in zip(lengths, contexts):
        index += torch.randperm(cache_rows, generator=gen)[:c].tolist()
        index += range(cache_rows + cu_q[-1], cache_rows + cu_q[-1] + n)
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + n + c)
    as_int = lambda xs: torch.tensor(xs, dtype=torch.int32)
    return q, k, v, k_cache, v_cache, torch.tensor(index, dtype=torch.int64), as_int(cu_q), as_int(cu_k)


def paged_reference(q, k, v, k_cache, v_cache, key_index, cu_q, cu_k, heads, scale):
    """float64, per chunk: its keys gathered, each key head repeated for its query heads, query i of n seeing the
    first ``keys - n + i + 1`` keys (``test_kernels.reference`` per query, with the numerators the build rounds)."""
    keys, values = torch.cat([k_cache, k]), torch.cat([v_cache, v])
    head_dim = q.shape[1] // heads
    group = heads // (k.shape[1] // head_dim)
    numerators = torch.bfloat16 if q.dtype == torch.bfloat16 and kernels.paired_bf16() else None
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(cu_q) - 1):
        idx = key_index[int(cu_k[b]) : int(cu_k[b + 1])]
        kb, vb = (x[idx].view(len(idx), -1, head_dim).repeat_interleave(group, 1).reshape(len(idx), -1)
                  for x in (keys, values))
        nq = int(cu_q[b + 1] - cu_q[b])
        for i in range(nq):
            row, visible = int(cu_q[b]) + i, len(idx) - nq + i + 1
            out[row] = reference(q[row : row + 1], kb[:visible], vb[:visible], torch.tensor([0, 1]),
                                 torch.tensor([0, visible]), heads, scale, numerators=numerators)[0]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (4, 2, 24), (6, 2, 128), (8, 1, 72)])
def test_paged_attention_matches_causal_attention_over_the_gathered_keys(dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads * 1000 + head_dim)
    problem = paged_problem(gen, dtype, [5, 1, 23, 9, 40], [0, 7, 12, 33, 0], heads, kv_heads, head_dim)
    out = kernels.paged_attention_cpu(*problem, heads, 0.21)
    assert out.dtype == dtype and out.shape == problem[0].shape
    assert_matches(out, paged_reference(*problem, heads, 0.21))
    assert bool((out[int(problem[6][-1]) :] == 0).all()), "filler rows must be zero"


def test_one_query_per_chunk_sees_every_key_and_is_the_last_row_of_the_full_chunk():
    """The last layer's call: each chunk's last token alone (cu_q = 0, 1, ...) gives, bitwise, that token's row of
    the whole chunk's call."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, kc, vc, index, cu_q, cu_k = paged_problem(gen, torch.float32, [4, 11, 1], [3, 0, 20], 4, 2, 32)
    full = kernels.paged_attention_cpu(q, k, v, kc, vc, index, cu_q, cu_k, 4, 0.3)
    ends = cu_q[1:].long() - 1
    last = kernels.paged_attention_cpu(q[ends], k, v, kc, vc, index, torch.arange(4, dtype=torch.int32), cu_k, 4, 0.3)
    assert torch.equal(last, full[ends])


def test_a_chunks_result_ignores_the_other_chunks_and_the_thread_count():
    gen = torch.Generator().manual_seed(6)
    q, k, v, kc, vc, index, cu_q, cu_k = paged_problem(gen, torch.float32, [30, 2, 17], [5, 9, 0], 4, 2, 64)
    together = kernels.paged_attention_cpu(q, k, v, kc, vc, index, cu_q, cu_k, 4, 0.3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernels.paged_attention_cpu(q, k, v, kc, vc, index[int(cu_k[1]) : int(cu_k[2])],
                                            torch.tensor([30, 32], dtype=torch.int32),
                                            torch.tensor([0, int(cu_k[2] - cu_k[1])], dtype=torch.int32), 4, 0.3)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone[30:32], together[30:32])


def test_a_wrong_key_index_changes_the_result():
    """The test above can fail: one key read twice and another never changes the outputs."""
    gen = torch.Generator().manual_seed(7)
    problem = list(paged_problem(gen, torch.float32, [6, 8], [10, 10], 2, 2, 16))
    right = kernels.paged_attention_cpu(*problem, 2, 0.3)
    problem[5] = problem[5].clone()
    problem[5][0] = problem[5][1]
    assert not torch.allclose(kernels.paged_attention_cpu(*problem, 2, 0.3), right)


def test_paged_attention_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(8)
    q, k, v, kc, vc, index, cu_q, cu_k = paged_problem(gen, torch.float32, [4, 3], [2, 0], 4, 2, 16)
    attend = kernels.paged_attention_cpu
    with pytest.raises(RuntimeError, match="key_index"):
        attend(q, k, v, kc, vc, torch.where(index == index[0], 10_000, index), cu_q, cu_k, 4, 0.3)
    with pytest.raises(RuntimeError, match="int64"):
        attend(q, k, v, kc, vc, index.int(), cu_q, cu_k, 4, 0.3)
    with pytest.raises(RuntimeError, match="dtype"):
        attend(q, k, v, kc.double(), vc, index, cu_q, cu_k, 4, 0.3)
    with pytest.raises(RuntimeError, match="queries"):  # chunk 0 given more queries than keys
        attend(q, k, v, kc, vc, index, torch.tensor([0, 7, 8], dtype=torch.int32), cu_k, 4, 0.3)
    with pytest.raises(RuntimeError, match="num_heads"):
        attend(q, k, v, kc, vc, index, cu_q, cu_k, 3, 0.3)
    three = lambda x: torch.randn(x.shape[0], 48)  # 3 key heads for 4 query heads
    with pytest.raises(RuntimeError, match="key_heads"):
        attend(q, three(k), three(v), three(kc), three(vc), index, cu_q, cu_k, 4, 0.3)


@pytest.mark.slow
def test_paged_attention_is_traceable_by_torch_compile():
    gen = torch.Generator().manual_seed(9)
    problem = paged_problem(gen, torch.float32, [4, 9], [3, 0], 4, 2, 16)
    torch.library.opcheck(torch.ops.xenc_lab.paged_attention.default, (*problem, 4, 0.3))

    def layer(*args):
        return kernels.paged_attention_cpu(*args, 4, 0.3) * 2

    assert torch.equal(torch.compile(layer, fullgraph=True)(*problem), layer(*problem))


def transformers_modules(dtype, size, gen):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(size, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size, generator=gen) * 0.5 + 1)
    return norm


def assert_rounding_close(out: torch.Tensor, want: torch.Tensor) -> None:
    """float32: within float32 rounding of the summation order; 16 bits: equal but for one rounding step in a few
    elements in 10^3."""
    assert out.dtype == want.dtype and out.shape == want.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        return
    step = torch.finfo(out.dtype).eps * (1 + want.float().abs())
    diff = (out.float() - want.float()).abs()
    assert bool((diff <= step * 1.01).all()), f"max diff {diff.max():.3g}"
    assert (diff > 0).double().mean() < 3e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [1024, 72, 5])
def test_rms_norm_is_transformers_rms_norm(dtype, size):
    gen = torch.Generator().manual_seed(size)
    norm = transformers_modules(dtype, size, gen)
    x = (torch.randn(37, size + 3, generator=gen) * 3).to(dtype)[:, :size]  # rows a stride apart
    assert_rounding_close(kernels.rms_norm_cpu(x, norm.weight.detach(), 1e-6), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [128, 80, 64, 6])
@pytest.mark.parametrize("normed", [True, False])
def test_rope_is_the_qk_norm_and_apply_rotary_pos_emb(dtype, head_dim, normed):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, tokens = 6, 2, 29
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    freqs = torch.arange(tokens).float()[:, None] * 10000 ** (-torch.arange(0, head_dim, 2).float() / head_dim)
    cos, sin = torch.cat((freqs.cos(), freqs.cos()), -1).to(dtype), torch.cat((freqs.sin(), freqs.sin()), -1).to(dtype)
    q_norm, k_norm = transformers_modules(dtype, head_dim, gen), transformers_modules(dtype, head_dim, gen)
    q, k = qk[:, :heads].transpose(0, 1)[None], qk[:, heads:].transpose(0, 1)[None]  # (1, heads, T, D)
    if normed:
        q, k = q_norm(q), k_norm(k)
    q, k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    want = torch.cat([q, k], dim=1)[0].transpose(0, 1)  # (T, heads + kv_heads, D)
    weight = torch.cat([q_norm.weight.expand(heads, -1), k_norm.weight.expand(kv_heads, -1)]).detach().contiguous()
    half = head_dim // 2
    negated = torch.cat((-sin[:, :half], sin[:, half:]), -1)  # the first half's sines negated (ops.rotary.rotate)
    out = kernels.rope_cpu(qk, weight if normed else None, 1e-6, cos, negated)
    assert_rounding_close(out, want.contiguous())
    # The test can fail: the sines' halves swapped give other values.
    assert not torch.allclose(kernels.rope_cpu(qk, None, 1e-6, cos, negated.roll(half, -1)).float(), want.float())


def test_row_kernels_reject_bad_inputs():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight"):
        kernels.rms_norm_cpu(x, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="float32, bfloat16 and float16"):
        kernels.rms_norm_cpu(x.double(), torch.ones(8).double(), 1e-6)
    table = torch.ones(4, 8)
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        kernels.rope_cpu(torch.randn(4, 2, 7), None, 1e-6, torch.ones(4, 7), torch.ones(4, 7))
    with pytest.raises(RuntimeError, match="cos"):
        kernels.rope_cpu(torch.randn(4, 2, 8), None, 1e-6, table[:3], table)
    with pytest.raises(RuntimeError, match="end to end"):
        kernels.rope_cpu(torch.randn(4, 8, 2).transpose(1, 2), None, 1e-6, table, table)
