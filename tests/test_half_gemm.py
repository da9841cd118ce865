"""xenc_lab's fp16 GEMM for bf16 layers (``kernels.linear_half_cpu``: bf16 values scaled by powers of two into
float16, products and sums in float16 over 64 consecutive k, float32 across them, bias, GELU or residual and one
rounding to bf16 on tiles in cache): to the bit against its stated arithmetic emulated in numpy, within the float16
sums' bound of float64, and as ``PrepackedLinear``'s ``gemm="fp16"``."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xenc_lab.cpu import kernels, native
from xenc_lab.cpu.info import cpu_info
from xenc_lab.cpu.prepacked import PrepackedLinear

from .test_f32_gemm import assert_compiled_as_one_op, exact
from .test_f32_gemm import problem as f32_problem
from .test_prepacked import needs_onednn_bf16

# Built is enough to run the op's own tests: a build whose self-check fails must fail them, not skip them.
needs_half_gemm = pytest.mark.skipif(
    not native.available() or not torch.ops.xenc_lab.half_gemm_built(),
    reason="xenc_lab's fp16 GEMM is not built here (needs AVX512-FP16 and a torch with cpublas' fp32 brgemm)",
)

problem = functools.partial(f32_problem, dtype=torch.bfloat16)  # bf16 layers' problems
CHUNK, ROW_MAX = kernels.HALF_GEMM_CHUNK, kernels.HALF_GEMM_ROW_MAX


def test_it_is_built_where_the_cpu_has_avx512_fp16():
    """A CPU with AVX512-FP16 gets the fp16 GEMM, and its self-check passes there (a faulty build would otherwise
    quietly fall back to the fp32 route)."""
    if "avx512_fp16" not in cpu_info().flags or not native.available() or not torch.ops.xenc_lab.gemm_f32_built():
        pytest.skip("no AVX512-FP16 here, or no native kernels with ATen's fp32 brgemm")
    assert torch.ops.xenc_lab.half_gemm_built() and kernels.half_gemm_available()


def _exponent(largest: np.ndarray, top: int) -> np.ndarray:
    """The power of two that brings ``largest`` below 2^top (0 for 0 and non-finite values)."""
    usable = (largest > 0) & np.isfinite(largest)
    return np.where(usable, np.clip(top - np.frexp(np.where(usable, largest, 1.0))[1], -126, 126), 0)


def emulated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual=None) -> torch.Tensor:
    """The op's arithmetic in numpy, before the rounding to bf16 (float32): each row of x scaled by 2^e to below
    2^7, W by 2^t to [1, 2), both rounded to float16; float16 FMAs (exact in float64, then rounded once) over chunks
    of 64 k from zero, each chunk's sum added in float32; the scales undone (exact) and the bias added in float32."""
    xs, ws = x.double().numpy(), weight.double().numpy()
    e = _exponent(np.abs(xs).max(axis=1, initial=0.0), ROW_MAX)
    t = _exponent(np.abs(ws).max(initial=0.0)[None], 1)[0]
    xh = (xs * np.exp2(e)[:, None]).astype(np.float32).astype(np.float16).astype(np.float64)
    wh = (ws * 2.0**t).astype(np.float32).astype(np.float16).astype(np.float64)
    sums = np.zeros((xs.shape[0], ws.shape[0]), np.float32)
    for k0 in range(0, xs.shape[1], CHUNK):
        acc = np.zeros(sums.shape, np.float16)
        for k in range(k0, min(xs.shape[1], k0 + CHUNK)):
            acc = (acc.astype(np.float64) + xh[:, k, None] * wh[None, :, k]).astype(np.float16)
        sums = sums + acc.astype(np.float32)
    v = sums * np.exp2(-e).astype(np.float32)[:, None] * np.float32(2.0**-t)
    v = v + (np.zeros(v.shape[1], np.float32) if bias is None else bias.float().numpy())
    if residual is not None:
        v = v + residual.float().numpy()
    return torch.from_numpy(v)


def run(x, weight, bias, activation="none", residual=None) -> torch.Tensor:
    blocks, exponent, padded = kernels.half_blocks(weight, bias)
    return kernels.linear_half_cpu(x, blocks, exponent, padded, weight.shape[0], activation, residual)


def scaled_rows(x: torch.Tensor, seed: int) -> torch.Tensor:
    """x with each row times its own power of two in [2^-24, 2^24]: rows far from the scale of the others."""
    g = torch.Generator().manual_seed(seed)
    return (x.float() * torch.exp2(torch.randint(-24, 25, (x.shape[0], 1), generator=g).float())).bfloat16()


@needs_half_gemm
@settings(max_examples=30, deadline=None)
@given(
    m=st.sampled_from([1, 5, 6, 7, 96, 97, 150]),
    k=st.sampled_from([1, 31, 64, 65, 130, 200]),
    n=st.sampled_from([1, 33, 127, 128, 129, 260]),
    residual=st.booleans(),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_equals_its_stated_arithmetic_to_the_bit(m, k, n, residual, bias, seed):
    """Partial row tiles and blocks, partial column blocks, one to four chunks of k, rows of any scale."""
    x, weight, b, r = problem(m, k, n, seed, bias)
    x, r = scaled_rows(x, seed), r if residual else None
    got = run(x, weight, b, "none", r)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert torch.equal(got, emulated(x, weight, b, r).bfloat16())


@needs_half_gemm
@settings(max_examples=20, deadline=None)
@given(
    m=st.sampled_from([1, 7, 97]),
    k=st.sampled_from([1, 64, 130, 384]),
    n=st.sampled_from([1, 129]),
    activation=st.sampled_from(["none", "gelu", "residual"]),
    seed=st.integers(0, 2**16),
)
def test_within_the_float16_sums_bound_of_the_exact_result(m, k, n, activation, seed):
    """Against float64: one bf16 rounding, plus at most (64 + 1) float16 roundings of sums no larger than
    sum |x| |w| per chunk (the standard bound for recursive summation), plus erf's 1.5e-7."""
    x, weight, b, r = problem(m, k, n, seed)
    r = r if activation == "residual" else None
    act = "gelu" if activation == "gelu" else "none"
    got = run(x, weight, b, act, r).double()
    want = exact(x, weight, b, act, r)
    sums = x.double().abs() @ weight.double().abs().T
    tol = want.abs() * 2**-8 + sums * (min(k, CHUNK) + 1) * 2**-11 * 1.14 + 1e-6  # 1.14: GELU's steepest slope
    assert ((got - want).abs() <= tol).all()


@needs_half_gemm
def test_gelu_is_applied_to_the_float32_sums():
    x, weight, b, _ = problem(40, 100, 150, seed=7)
    got = run(x, weight, b, "gelu").double()
    want = torch.nn.functional.gelu(emulated(x, weight, b).double())
    assert ((got - want).abs() <= want.abs() * 2**-8 + 1e-6).all()


@needs_half_gemm
def test_a_row_depends_on_itself_alone_whatever_its_neighbours_and_the_thread_count():
    """Each row has its own scale: a row gives the same bits beside rows a million times larger or smaller, alone,
    in any block, on one thread or two."""
    x, weight, b, _ = problem(200, 130, 150, seed=8)
    full = run(x, weight, b, "gelu")
    mixed = x.clone()
    mixed[::2] = (x[::2].float() * 2.0**20).bfloat16()
    mixed[1::4] = (x[1::4].float() * 2.0**-20).bfloat16()
    rows = torch.arange(3, 200, 4)  # untouched rows, between rescaled ones
    assert torch.equal(run(mixed, weight, b, "gelu")[rows], full[rows])
    for start, stop in ((0, 1), (5, 12), (95, 98), (150, 200)):
        assert torch.equal(run(x[start:stop], weight, b, "gelu"), full[start:stop])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run(x, weight, b, "gelu"), full)
    finally:
        torch.set_num_threads(threads)


@needs_half_gemm
def test_rows_of_any_magnitude_zeros_and_non_finite_values():
    """Rows scaled far beyond float16's range are computed as well as ordinary ones; a zero row gives the bias;
    an inf or NaN reaches its own row only."""
    x, weight, b, _ = problem(6, 96, 40, seed=9)
    x = x.float()
    x[0] *= 1e30
    x[1] *= 1e-30
    x[2] = 0
    x[3, 5] = float("inf")
    x[4, 7] = float("nan")
    x = x.bfloat16()
    got = run(x, weight, b).double()
    want = exact(x, weight, b, "none")
    sums = x.double().abs() @ weight.double().abs().T
    ok = [0, 1, 2, 5]
    assert ((got[ok] - want[ok]).abs() <= want[ok].abs() * 2**-8 + sums[ok] * 65 * 2**-11 + 1e-6).all()
    assert torch.equal(got[2], b.double())
    assert not got[3].isfinite().any() and got[4].isnan().all()


@needs_half_gemm
def test_weights_of_any_magnitude():
    x, weight, b, _ = problem(20, 70, 30, seed=10)
    for scale in (2.0**-60, 2.0**-14, 1.0, 2.0**20):
        w = (weight.float() * scale).bfloat16()
        assert torch.equal(run(x, w, b), emulated(x, w, b).bfloat16())
        want = exact(x, w, b, "none")
        sums = x.double().abs() @ w.double().abs().T
        assert ((run(x, w, b).double() - want).abs() <= want.abs() * 2**-8 + sums * 65 * 2**-11 + 1e-6).all()


def test_half_blocks_packs_w_transposed_scaled_into_float16_blocks():
    weight = torch.tensor([[0.75, -3.0], [0.5, 0.25], [1.5, 0.0]]).bfloat16()  # largest 3 -> times 2^-1
    blocks, exponent, padded = kernels.half_blocks(weight, torch.tensor([1.0, 2.0, 3.0]))
    assert exponent == -1 and blocks.dtype == torch.float16 and blocks.shape == (1, 2, kernels.HALF_GEMM_COLS)
    assert blocks[0, :, :3].tolist() == [[0.375, 0.25, 0.75], [-1.5, 0.125, 0.0]]
    assert not blocks[0, :, 3:].any() and padded[:3].tolist() == [1.0, 2.0, 3.0] and not padded[3:].any()
    assert kernels.half_blocks(torch.zeros(2, 3), None)[1] == 0
    with pytest.raises(ValueError, match="finite weight"):
        kernels.half_blocks(torch.tensor([[1.0, float("inf")]]), None)


@needs_half_gemm
def test_strided_rows_and_a_strided_residual_are_read_in_place():
    x, weight, b, residual = problem(64, 80, 70, seed=11)
    got = run(x[::2], weight, b, "none", residual[::2])
    assert torch.equal(got, run(x[::2].contiguous(), weight, b, "none", residual[::2].contiguous()))


@needs_half_gemm
def test_no_rows_give_an_empty_result():
    _, weight, b, _ = problem(1, 8, 5, seed=3)
    got = run(torch.empty(0, 8, dtype=torch.bfloat16), weight, b)
    assert got.shape == (0, 5) and got.dtype == torch.bfloat16


@needs_half_gemm
def test_bad_arguments_are_refused_with_what_was_expected():
    x, weight, b, residual = problem(10, 32, 20, seed=4)
    blocks, exponent, padded = kernels.half_blocks(weight, b)
    op = torch.ops.xenc_lab.linear_half
    with pytest.raises(RuntimeError, match="(?i)2-D bfloat16"):
        op(x.float(), blocks, exponent, padded, 20, "none", None)
    with pytest.raises(RuntimeError, match="float16 blocks"):
        op(x[:, :16], blocks, exponent, padded, 20, "none", None)
    with pytest.raises(RuntimeError, match="float16 blocks"):
        op(x, blocks.float(), exponent, padded, 20, "none", None)
    with pytest.raises(RuntimeError, match="does not fit"):
        op(x, blocks, exponent, padded, 129, "none", None)
    with pytest.raises(RuntimeError, match="exponent must lie"):
        op(x, blocks, 127, padded, 20, "none", None)
    with pytest.raises(RuntimeError, match='"none" or "gelu"'):
        op(x, blocks, exponent, padded, 20, "relu", None)
    with pytest.raises(RuntimeError, match="plain product"):
        op(x, blocks, exponent, padded, 20, "gelu", residual)
    with pytest.raises(RuntimeError, match="residual must be"):
        op(x, blocks, exponent, padded, 20, "none", residual.float())


@needs_half_gemm
def test_the_op_is_registered_for_tracing():
    x, weight, b, residual = problem(33, 48, 70, seed=5)
    blocks, exponent, padded = kernels.half_blocks(weight, b)
    op = torch.ops.xenc_lab.linear_half.default
    torch.library.opcheck(op, (x, blocks, exponent, padded, 70, "none", residual))
    torch.library.opcheck(op, (x, blocks, exponent, padded, 70, "gelu", None))


@needs_half_gemm
def test_the_self_check_turns_away_a_wrong_layout_or_scale(monkeypatch):
    real = kernels.half_blocks

    def untransposed(weight, bias):
        blocks, exponent, padded = real(weight, bias)
        return blocks.transpose(1, 2).contiguous().view(blocks.shape), exponent, padded

    def unscaled(weight, bias):
        blocks, exponent, padded = real(weight, bias)
        return blocks, exponent + 1, padded

    for wrong in (untransposed, unscaled):
        monkeypatch.setattr(kernels, "half_blocks", wrong)
        assert kernels._half_gemm_check() is False
    monkeypatch.setattr(kernels, "half_blocks", real)
    assert kernels._half_gemm_check() is True


@needs_half_gemm
@needs_onednn_bf16
def test_prepacked_linear_runs_it_for_gemm_fp16():
    """The layer's calls (GELU, residual, row slices, 3-D input, a column-strided residual) are the op's."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(384, 320).to(torch.bfloat16).requires_grad_(False)
    x, residual = torch.randn(300, 384, dtype=torch.bfloat16), torch.randn(300, 320, dtype=torch.bfloat16)
    layer = PrepackedLinear(linear, gemm="fp16")
    assert layer.gemm == "fp16" and layer.packed.dtype == torch.float16 and layer.packed.shape == (3, 384, 128)
    w, bias = linear.weight, linear.bias
    assert torch.equal(layer(x), run(x, w, bias))
    assert torch.equal(layer(x, activation="gelu"), run(x, w, bias, "gelu"))
    assert torch.equal(layer(x, residual=residual), run(x, w, bias, "none", residual))
    assert torch.equal(layer(x, residual=residual.t().contiguous().t()), run(x, w, bias, "none", residual))
    assert torch.equal(layer.rows(64, 320)(x), run(x, w[64:], bias[64:]))
    assert torch.equal(layer(x.view(3, 100, 384)), run(x, w, bias).view(3, 100, 320))
    assert layer.rows(64, 320).gemm == "fp16"


@needs_onednn_bf16
def test_asked_for_where_it_cannot_run_the_layer_takes_the_fp32_route(monkeypatch):
    torch.manual_seed(2)
    linear = torch.nn.Linear(32, 48).to(torch.bfloat16).requires_grad_(False)
    broken = torch.nn.Linear(32, 48).to(torch.bfloat16).requires_grad_(False)
    broken.weight[3, 4] = float("nan")
    assert PrepackedLinear(broken, gemm="fp16").gemm == "fp32"  # a non-finite weight
    monkeypatch.setattr("xenc_lab.cpu.prepacked.half_gemm_available", lambda: False)
    layer = PrepackedLinear(linear, gemm="fp16")
    assert layer.gemm == "fp32"
    x = torch.randn(20, 32, dtype=torch.bfloat16)
    assert ((layer(x).double() - linear(x).double()).abs() <= linear(x).double().abs() * 2**-7 + 1e-30).all()


@pytest.mark.slow
@needs_half_gemm
@needs_onednn_bf16
def test_compiled_it_stays_one_op_on_bf16_tensors():
    torch.manual_seed(1)
    linear = PrepackedLinear(torch.nn.Linear(64, 96).to(torch.bfloat16).requires_grad_(False), gemm="fp16")
    assert linear.gemm == "fp16"
    assert_compiled_as_one_op(linear)
