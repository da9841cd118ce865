"""The kernel's tile path (bfloat16, float16: Q K^T and P V as oneDNN batch-reduce GEMMs, on AMX tiles where the
CPU has them) against float64 attention, and against the kernel.

It runs wherever oneDNN takes the dtype with the VNNI layout the path packs: here bfloat16 on AVX-512 dot products
(the same GEMM interface, other instructions); float16 only on CPUs with AMX-FP16, elsewhere its tests skip.
Tolerances are those of the kernel's tests (1e-2 bf16, 2e-3 fp16, times 1 + |reference|): the path rounds the
softmax numerators to the input type before they weight the values, which adds about one rounding of the dtype.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xenc_lab.batch import pack
from xenc_lab import attention_paths as tuning
from xenc_lab.cpu import kernels, native
from xenc_lab.cpu.info import CpuInfo, cpu_info
from xenc_lab.ops.attention import packed_attention

from .test_batch import encodings
from .test_kernels import (
    TOLERANCE,
    check_filler_rows_are_zero_and_never_read,
    check_results_do_not_depend_on_threads_or_batch_neighbours,
    check_traceable_by_torch_compile,
    fused_qkv,
    offsets,
    random_lengths,
    reference,
)

DTYPES = [torch.bfloat16, torch.float16]


def runs_here(dtype: torch.dtype) -> bool:
    return native.available() and kernels.tiles_available(dtype)


@pytest.fixture(params=DTYPES, ids=["bfloat16", "float16"])
def dtype(request):
    if not native.available():
        pytest.skip("the native kernels could not be built here")
    if not runs_here(request.param):
        pytest.skip(f"the tile path does not run here in {request.param} (oneDNN's GEMMs take another layout or "
                    "none; see kernels.tiles_available)")
    return request.param


def tiles(q, k, v, cu_q, cu_k, num_heads, scale, window=None):
    return kernels.packed_attention_cpu(q, k, v, cu_q, cu_k, num_heads, scale, window, tiles=True)


def assert_close_to(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.is_contiguous() and out.shape == ref.shape
    err = (out.double() - ref).abs()
    assert (err <= TOLERANCE[out.dtype] * (1 + ref.abs())).all(), f"max abs error {err.max():.3g}"


@pytest.mark.parametrize("head_dim", [1, 7, 8, 32, 33, 64, 80, 128, 256])
@pytest.mark.parametrize("window", [None, 0, 8, 100])
def test_matches_reference(dtype, head_dim, window):
    gen = torch.Generator().manual_seed(head_dim + (window or 0))
    cu = offsets([*random_lengths(gen, 6), 1, 32, 33])  # a lone token, one whole key tile, one key past it
    q, k, v = fused_qkv(int(cu[-1]), 3, head_dim, dtype, gen, spread=2.0)  # strided views of one tensor
    out = tiles(q, k, v, cu, cu, 3, head_dim**-0.5, window)
    assert out.dtype == dtype
    ref = reference(q, k, v, cu, cu, 3, head_dim**-0.5, window)
    assert_close_to(out, ref)
    # No larger than the kernel's error by more than the rounding of the numerators.
    kernel = kernels.packed_attention_cpu(q, k, v, cu, cu, 3, head_dim**-0.5, window)
    eps = torch.finfo(dtype).eps
    assert (out.double() - ref).abs().max() <= (kernel.double() - ref).abs().max() + 2 * eps * (1 + ref.abs().max())


def test_the_tile_path_is_the_one_that_ran(dtype):
    """Its arithmetic differs from the kernel's (rounded numerators, GEMM summation order): equal outputs would
    mean the kernel ran instead."""
    gen = torch.Generator().manual_seed(1)
    cu = offsets(random_lengths(gen, 8))
    q, k, v = fused_qkv(int(cu[-1]), 4, 32, dtype, gen)
    assert not torch.equal(tiles(q, k, v, cu, cu, 4, 0.2), kernels.packed_attention_cpu(q, k, v, cu, cu, 4, 0.2))


@pytest.mark.parametrize("window", [None, 8])
def test_first_token_only_and_long_sequences(dtype, window):
    gen = torch.Generator().manual_seed(2)
    cu = offsets([5, 40, 300, 1000])  # 1000: many query blocks and key tiles
    q, k, v = fused_qkv(int(cu[-1]), 2, 64, dtype, gen)
    out = tiles(q, k, v, cu, cu, 2, 0.125, window)
    assert_close_to(out, reference(q, k, v, cu, cu, 2, 0.125, window))
    first, cu_first = q[cu[:-1].long()], torch.arange(len(cu), dtype=torch.int32)
    alone = tiles(first, k, v, cu_first, cu, 2, 0.125, window)
    assert_close_to(alone, reference(first, k, v, cu_first, cu, 2, 0.125, window))
    # A query's result does not depend on the queries computed with it: bitwise equal.
    assert torch.equal(alone, out[cu[:-1].long()])


def test_a_negative_scale(dtype):
    gen = torch.Generator().manual_seed(3)
    cu = offsets([17, 70])
    q, k, v = fused_qkv(int(cu[-1]), 2, 32, dtype, gen)
    assert_close_to(tiles(q, k, v, cu, cu, 2, -0.3), reference(q, k, v, cu, cu, 2, -0.3))


def test_filler_rows_are_zero_and_never_read(dtype):
    check_filler_rows_are_zero_and_never_read(tiles, dtype, assert_close_to)


def test_results_do_not_depend_on_threads_or_batch_neighbours(dtype):
    check_results_do_not_depend_on_threads_or_batch_neighbours(tiles, dtype)


@settings(max_examples=25, deadline=None)
@given(encodings(max_pairs=8, max_len=80), st.sampled_from([1, 2, 4]), st.integers(0, 2**31 - 1))
def test_packed_attention_on_tiles_equals_sdpa_on_each_pair_alone(case, num_heads, seed):
    """Through the models' entry point, on the batches ``pack`` makes (pages, a filler tail)."""
    dtype = torch.bfloat16
    if not runs_here(dtype):
        pytest.skip("the tile path does not run here in bfloat16")
    enc, pairs, page_size = case
    batch = pack(enc, pairs, page_size)
    d = num_heads * 16
    qkv = torch.randn(batch.input_ids.shape[0], 3 * d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    out = packed_attention(qkv, batch, num_heads, "tiles")
    cu = batch.cu_seqlens.tolist()
    for s, e in itertools.pairwise(cu):
        q, k, v = (qkv[s:e, i * d : (i + 1) * d].double().view(e - s, num_heads, 16).transpose(0, 1) for i in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(e - s, d)
        assert_close_to(out[s:e].contiguous(), ref)


def test_it_runs_where_onednn_takes_vnni_pairs():
    """oneDNN's bf16 GEMMs take VNNI pairs on every CPU with AVX512-BF16 or AMX-BF16, and its fp16 GEMMs on CPUs with
    AMX-FP16: there the self-check must pass (a faulty path would otherwise make every test here skip)."""
    if not native.available() or not torch.ops.xenc_lab.tiles_built():
        pytest.skip("the tile path is not built here (no AVX-512, or a torch without cpublas brgemm)")
    flags = cpu_info().flags
    if not {"avx512_bf16", "amx_bf16"} & flags:
        pytest.skip("this CPU has neither AVX512-BF16 nor AMX-BF16")
    assert kernels.tiles_available(torch.bfloat16)
    if "amx_fp16" in flags:
        assert kernels.tiles_available(torch.float16)


@pytest.mark.slow
def test_traceable_by_torch_compile(dtype):
    check_traceable_by_torch_compile(torch.ops.xenc_lab.packed_attention_tiles, tiles, dtype)


def test_float32_has_no_tile_path():
    assert not kernels.tiles_available(torch.float32)
    if native.available() and torch.ops.xenc_lab.tiles_built():
        q, cu = torch.randn(4, 8), torch.tensor([0, 4])
        with pytest.raises(RuntimeError, match="bfloat16 or float16"):
            torch.ops.xenc_lab.packed_attention_tiles(q, q, q, cu, cu, 2, 0.5, -1)


@pytest.mark.skipif(not native.available(), reason="the native kernels could not be built here")
@pytest.mark.parametrize("fault", ["raises", "wrong", "nan", "right"])
def test_the_self_check_turns_a_faulty_tile_path_away(monkeypatch, fault):
    """Whether the tile path is used rests on a check against the kernel, not on the CPU's flags: a GEMM that
    fails, or that reads the packed layout otherwise (wrong numbers), leaves the kernel in charge."""
    kernel = torch.ops.xenc_lab.packed_attention

    def faulty(q, k, v, cu_q, cu_k, num_heads, scale, window):
        if fault == "raises":
            raise RuntimeError("BFloat16 Brgemm VNNI format is only supported on X64 when ...")
        out = kernel(q, k, v, cu_q, cu_k, num_heads, scale, window)
        if fault == "wrong":
            return out.flip(0)
        return out * float("nan") if fault == "nan" else out

    monkeypatch.setattr(torch.ops.xenc_lab, "packed_attention_tiles", faulty)
    assert kernels._tiles_check(torch.bfloat16) == (fault == "right")


def test_measured_among_three_paths_where_the_cpu_has_amx(monkeypatch, tmp_path):
    """With AMX for the dtype, the tile path is timed beside the kernel and SDPA (unfaked, on this CPU's
    instructions), and the fastest is recorded under a key that names the candidates."""
    if not runs_here(torch.bfloat16):
        pytest.skip("the tile path does not run here in bfloat16")
    monkeypatch.setenv("XENC_LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("XENC_LAB_CPU_ATTENTION", raising=False)
    monkeypatch.setattr(tuning, "_choices", {})
    monkeypatch.setattr(tuning, "TUNING_LENGTHS", (40,))
    rates = tuning.attention_rates(2, 16, torch.bfloat16, 40, tokens=400, repeats=2)
    assert set(rates) == {"kernel", "tiles", "sdpa"}
    monkeypatch.setattr(tuning, "cpu_info", lambda: CpuInfo("GenuineIntel", "test CPU", frozenset({"amx_bf16"})))
    path = tuning.cpu_attention_path(torch.bfloat16, 2, 16)
    assert path in tuning.PATHS
    record = next(tmp_path.glob("kernels/*/*/attention-paths.json")).read_text()
    assert f'"bfloat16-2x16-{torch.get_num_threads()}threads-kernel+tiles+sdpa": "{path}"' in record


def test_a_bfloat16_model_scores_alike_on_the_tile_path(monkeypatch, tiny_dir):
    """End to end: a bf16 Scorer with attention forced onto the tile path scores as on the kernel, within bf16."""
    if not runs_here(torch.bfloat16):
        pytest.skip("the tile path does not run here in bfloat16")
    from xenc_lab import Scorer
    from xenc_lab.bench.workloads import make_pairs

    pairs = make_pairs("mixed", 24, seed=5)
    monkeypatch.setenv("XENC_LAB_CPU_ATTENTION", "kernel")
    kernel = Scorer(tiny_dir, dtype="bfloat16").predict(pairs, activation_fn=torch.nn.Identity())
    monkeypatch.setenv("XENC_LAB_CPU_ATTENTION", "tiles")  # read when a Scorer loads, never while it scores
    scorer = Scorer(tiny_dir, dtype="bfloat16")
    assert scorer.choices.attention == "tiles"
    on_tiles = scorer.predict(pairs, activation_fn=torch.nn.Identity())
    assert np.std(kernel) > 0.1, "scores that barely vary would prove nothing"
    assert not np.array_equal(kernel, on_tiles), "the tile path did not run"
    np.testing.assert_allclose(on_tiles, kernel, atol=0.05 * (1 + np.abs(kernel).max()))
