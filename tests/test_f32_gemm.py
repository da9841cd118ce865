"""xenc_lab's fp32 GEMM (``kernels.linear_f32_cpu``: ATen's fp32 brgemm with the bias, GELU or residual applied to
each output tile in cache) against float64, and as ``PrepackedLinear``'s path for float32 layers with GELU."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xenc_lab import kernels, layers
from xenc_lab.cpuinfo import CpuInfo
from xenc_lab.layers import PrepackedLinear

# Built is enough to run the op's own tests: a build whose self-check fails must fail them, not skip them.
needs_gemm = pytest.mark.skipif(
    not kernels.load() or not torch.ops.xenc_lab.gemm_f32_built(),
    reason="xenc_lab's fp32 GEMM is not built here (needs AVX2 and FMA, or AVX-512, and a torch with cpublas' fp32 "
    "brgemm)",
)


@needs_gemm
def test_it_runs_wherever_it_is_built():
    assert kernels.f32_gemm_available()


def problem(m: int, k: int, n: int, seed: int, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2
    weight = torch.randn(n, k, generator=g) / max(k, 1) ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    residual = torch.randn(m, n, generator=g) * 4
    return x, weight, b, residual


def exact(x, weight, bias, activation: str, residual=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(result, product before the activation), float64, rounded nowhere."""
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    product = y
    if activation == "gelu":
        y = y * 0.5 * (1 + torch.erf(y / 2**0.5))
    if residual is not None:
        y = y + residual.double()
    return y, product


def assert_float32_rounding_from(got: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor], x, weight) -> None:
    """Within the float32 sums' error bound (k terms), a float32 rounding of the result, and erf's 1.5e-7."""
    result, product = want
    assert got.dtype == torch.float32 and got.shape == result.shape and got.is_contiguous()
    sums = x.double().abs() @ weight.double().abs().T * (x.shape[1] + 2) * 2**-24
    tol = result.abs() * 2**-23 + product.abs() * 1e-7 + 1.2 * sums + 1e-7
    assert ((got.double() - result).abs() <= tol).all(), float(((got.double() - result).abs() - tol).max())


@needs_gemm
@settings(max_examples=40, deadline=None)
@given(
    m=st.sampled_from([1, 2, 5, 95, 96, 97, 200]),
    k=st.sampled_from([1, 15, 16, 17, 72, 384]),
    n=st.sampled_from([1, 15, 63, 64, 65, 130]),
    activation=st.sampled_from(["none", "gelu", "residual"]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_float32_rounding_from_the_exact_result(m, k, n, activation, bias, seed):
    x, weight, b, residual = problem(m, k, n, seed, bias)
    blocks, padded = kernels.gemm_blocks(weight, b)
    add = residual if activation == "residual" else None
    act = "gelu" if activation == "gelu" else "none"
    got = kernels.linear_f32_cpu(x, blocks, padded, n, act, add)
    assert_float32_rounding_from(got, exact(x, weight, b, act, add), x, weight)


@needs_gemm
def test_gelu_equals_torch_gelu_after_the_product_within_float32_rounding():
    """What sentence-transformers computes: a float32 product, then torch's GELU (the same erf approximation)."""
    x, weight, b, _ = problem(300, 384, 1536, seed=6)
    blocks, padded = kernels.gemm_blocks(weight, b)
    got = kernels.linear_f32_cpu(x, blocks, padded, 1536, "gelu")
    theirs = torch.nn.functional.gelu(torch.nn.functional.linear(x, weight, b))
    assert (got - theirs).abs().max() <= 2e-5  # products of ~40 here: float32 sums differ by ~1e-5 in order alone


@needs_gemm
def test_strided_rows_and_a_strided_residual_are_read_in_place():
    x, weight, b, residual = problem(2 * 150, 40, 70, seed=1)
    blocks, padded = kernels.gemm_blocks(weight, b)
    got = kernels.linear_f32_cpu(x[::2], blocks, padded, 70, "none", residual[::2])
    assert torch.equal(got, kernels.linear_f32_cpu(x[::2].contiguous(), blocks, padded, 70, "none", residual[::2].contiguous()))
    assert_float32_rounding_from(got, exact(x[::2], weight, b, "none", residual[::2]), x[::2], weight)


@needs_gemm
def test_rows_are_bitwise_independent_of_the_other_rows_and_of_the_thread_count():
    x, weight, b, _ = problem(300, 384, 200, seed=2)
    blocks, padded = kernels.gemm_blocks(weight, b)
    full = kernels.linear_f32_cpu(x, blocks, padded, 200, "gelu")
    for start, stop in ((0, 1), (37, 38), (95, 97), (100, 300), (250, 300)):
        assert torch.equal(kernels.linear_f32_cpu(x[start:stop], blocks, padded, 200, "gelu"), full[start:stop])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.linear_f32_cpu(x, blocks, padded, 200, "gelu"), full)
    finally:
        torch.set_num_threads(threads)


@needs_gemm
def test_no_rows_give_an_empty_result():
    _, weight, b, _ = problem(1, 8, 5, seed=3)
    blocks, padded = kernels.gemm_blocks(weight, b)
    got = kernels.linear_f32_cpu(torch.empty(0, 8), blocks, padded, 5)
    assert got.shape == (0, 5) and got.dtype == torch.float32


@needs_gemm
def test_gelu_is_exact_gelu_in_the_tails_and_keeps_nan():
    """erf by Abramowitz-Stegun: large |x| give x and 0 as they should; a NaN stays a NaN."""
    weight = torch.ones(1, 1)  # one value per row: a NaN reaches its own row only
    x = torch.tensor([-30.0, -6.0, -3.0, -1.0, -0.1, 0.0, 0.1, 1.0, 3.0, 6.0, 30.0, 1e30, -1e30, float("nan"), 2.5, -2.5])
    blocks, padded = kernels.gemm_blocks(weight, None)
    got = kernels.linear_f32_cpu(x[:, None], blocks, padded, 1, "gelu")[:, 0]
    want = torch.nn.functional.gelu(x.double())
    finite = ~want.isnan()
    assert torch.isnan(got[13]) and finite.sum() == 15
    assert ((got.double() - want)[finite].abs() <= want[finite].abs() * 2**-22 + x.double()[finite].abs() * 1e-7).all()


@needs_gemm
def test_bad_arguments_are_refused_with_what_was_expected():
    x, weight, b, residual = problem(10, 32, 20, seed=4)
    blocks, padded = kernels.gemm_blocks(weight, b)
    op = torch.ops.xenc_lab.linear_f32
    with pytest.raises(RuntimeError, match="2-D Float"):
        op(x.bfloat16(), blocks, padded, 20, "none", None)
    with pytest.raises(RuntimeError, match="float32 blocks"):
        op(x[:, :16], blocks, padded, 20, "none", None)
    with pytest.raises(RuntimeError, match="does not fit"):
        op(x, blocks, padded, 65, "none", None)
    with pytest.raises(RuntimeError, match='"none" or "gelu"'):
        op(x, blocks, padded, 20, "relu", None)
    with pytest.raises(RuntimeError, match="plain product"):
        op(x, blocks, padded, 20, "gelu", residual)
    with pytest.raises(RuntimeError, match="residual must be"):
        op(x, blocks, padded, 20, "none", residual.bfloat16())


@needs_gemm
def test_the_op_is_registered_for_tracing():
    x, weight, b, residual = problem(33, 48, 70, seed=5)
    blocks, padded = kernels.gemm_blocks(weight, b)
    torch.library.opcheck(torch.ops.xenc_lab.linear_f32.default, (x, blocks, padded, 70, "none", residual))
    torch.library.opcheck(torch.ops.xenc_lab.linear_f32.default, (x, blocks, padded, 70, "gelu", None))


@needs_gemm
def test_the_self_check_turns_away_a_wrong_layout(monkeypatch):
    """``f32_gemm_available`` computes a problem both ways: a weight packed as W rather than W^T blocks is caught."""
    real = kernels.gemm_blocks

    def untransposed(weight, bias):
        blocks, padded = real(weight, bias)
        return blocks.transpose(1, 2).contiguous().view(blocks.shape), padded

    monkeypatch.setattr(kernels, "gemm_blocks", untransposed)
    assert kernels._f32_gemm_check() is False
    monkeypatch.setattr(kernels, "gemm_blocks", real)
    assert kernels._f32_gemm_check() is True


def test_the_choice_is_measured_cpus_only_and_can_be_forced(monkeypatch):
    """``fused`` by default only where it was measured faster (x86 without AVX-512) and where it runs; the variable
    forces either way, ``fused`` falling back where it cannot run."""
    monkeypatch.delenv("XENC_LAB_F32_GELU_GEMM", raising=False)
    monkeypatch.setattr(layers, "f32_gemm_available", lambda: True)
    monkeypatch.setattr(layers, "cpu_info", lambda: CpuInfo("AuthenticAMD", "AMD EPYC", frozenset({"avx2", "fma"})))
    assert layers.f32_gelu_gemm() == "fused"
    monkeypatch.setattr(layers, "cpu_info", lambda: CpuInfo("GenuineIntel", "Xeon", frozenset({"avx2", "avx512f"})))
    assert layers.f32_gelu_gemm() == "onednn"
    monkeypatch.setenv("XENC_LAB_F32_GELU_GEMM", "fused")
    assert layers.f32_gelu_gemm() == "fused"
    monkeypatch.setattr(layers, "f32_gemm_available", lambda: False)
    assert layers.f32_gelu_gemm() == "onednn"
    monkeypatch.setenv("XENC_LAB_F32_GELU_GEMM", "sometimes")
    with pytest.raises(ValueError, match="XENC_LAB_F32_GELU_GEMM must be one of fused, onednn"):
        layers.f32_gelu_gemm()


needs_prepacked = pytest.mark.skipif(
    not PrepackedLinear.supported(torch.float32, torch.device("cpu")), reason="needs oneDNN on this CPU"
)


@needs_gemm
@needs_prepacked
def test_prepacked_linear_takes_it_for_gelu_only_and_copies_the_weight_at_the_first_gelu(monkeypatch):
    torch.manual_seed(0)
    linear = torch.nn.Linear(384, 320).requires_grad_(False)
    x, residual = torch.randn(300, 384), torch.randn(300, 320)
    monkeypatch.setenv("XENC_LAB_F32_GELU_GEMM", "onednn")
    onednn = PrepackedLinear(linear)
    monkeypatch.setenv("XENC_LAB_F32_GELU_GEMM", "fused")
    fused = PrepackedLinear(linear)
    assert (onednn.gelu_gemm, fused.gelu_gemm) == ("onednn", "fused")
    for call in (lambda m: m(x), lambda m: m(x, residual=residual), lambda m: m.rows(64, 320)(x)):
        assert torch.equal(call(onednn), call(fused))  # no GELU: oneDNN's GEMM either way
    assert fused._gelu_blocks is None  # no copy before the first GELU call
    for call in (lambda m: m(x, activation="gelu"), lambda m: m(x.view(3, 100, 384), activation="gelu"),
                 lambda m: m(x[:, :384].t().contiguous().t(), activation="gelu"),
                 lambda m: m.rows(64, 320)(x, activation="gelu")):
        a, b = call(onednn), call(fused)
        assert a.shape == b.shape and b.dtype == torch.float32
        assert (a - b).abs().max() <= 1e-5 * (1 + a.abs().max())
    assert fused._gelu_blocks is not None and fused._gelu_blocks[0].shape == (5, 384, 64)
    assert onednn._gelu_blocks is None


@needs_gemm
@needs_prepacked
def test_compiled_it_computes_what_it_computes_eagerly(monkeypatch):
    monkeypatch.setenv("XENC_LAB_F32_GELU_GEMM", "fused")
    torch.manual_seed(1)
    linear = PrepackedLinear(torch.nn.Linear(64, 96).requires_grad_(False))
    x = torch.randn(37, 64)
    compiled = torch.compile(lambda t: linear(t, activation="gelu") * 2, dynamic=True, fullgraph=True)
    assert torch.equal(compiled(x), linear(x, activation="gelu") * 2)


@needs_gemm
@needs_prepacked
def test_bf16_layers_never_take_it_even_on_their_fp32_route(monkeypatch):
    """A bf16 layer whose products run as fp32 GEMMs through torch's ops holds a float32 copy of its weight, but its
    inputs stay bf16: the fp32 GEMM is for float32 layers only."""
    monkeypatch.setenv("XENC_LAB_F32_GELU_GEMM", "fused")
    torch.manual_seed(2)
    linear = PrepackedLinear(torch.nn.Linear(64, 96).to(torch.bfloat16).requires_grad_(False), gemm="fp32", fused=False)
    assert linear.gelu_gemm is None
    x = torch.randn(10, 64, dtype=torch.bfloat16)
    want = torch.nn.functional.gelu(torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float()))
    got = linear(x, activation="gelu")
    assert got.dtype == torch.bfloat16 and ((got.float() - want).abs() <= want.abs() * 2**-7 + 1e-6).all()
