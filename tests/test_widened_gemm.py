"""xenc_lab's GEMM for bf16 and fp16 layers (``kernels.linear_widened_cpu``: fp32 products of the 16-bit values with
the widening, bias, GELU, residual and rounding done on blocks in cache) against float64, and as ``PrepackedLinear``'s
path where bf16 or fp16 products run as fp32 GEMMs."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xenc_lab import kernels
from xenc_lab.layers import PrepackedLinear, onednn_bf16, onednn_fp16, prepack_linears

# Built is enough to run the op's own tests: a build whose self-check fails must fail them, not skip them.
needs_gemm = pytest.mark.skipif(
    not kernels.load() or not torch.ops.xenc_lab.gemm_f32_built(),
    reason="xenc_lab's fp32 GEMMs are not built here (need AVX2 and FMA or AVX-512, and a torch with cpublas' fp32 brgemm)",
)
DTYPES = [torch.bfloat16, torch.float16]
# Significant bits after the rounding to each dtype.
BITS = {torch.bfloat16: 8, torch.float16: 11}


@needs_gemm
def test_it_runs_wherever_it_is_built():
    """Built means AVX2 and FMA (or AVX-512) and ATen's fp32 brgemm: there the self-check passes, and bf16 and fp16
    layers whose products run in fp32 take this GEMM (a faulty build would otherwise quietly fall back to torch's
    ops)."""
    assert kernels.widened_gemm_available()


def problem(m: int, k: int, n: int, seed: int, bias: bool = True, dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    weight = (torch.randn(n, k, generator=g) / max(k, 1) ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    residual = (torch.randn(m, n, generator=g) * 4).to(dtype)
    return x, weight, b, residual


def exact(x, weight, bias, activation: str, residual=None) -> torch.Tensor:
    """float64, rounded nowhere."""
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    if activation == "gelu":
        y = y * 0.5 * (1 + torch.erf(y / 2**0.5))
    if residual is not None:
        y = y + residual.double()
    return y


def assert_one_rounding_from(got: torch.Tensor, want: torch.Tensor, x, weight) -> None:
    """Within one rounding to x's dtype of the exact value, plus the float32 sums' error and erf's (1.5e-7)."""
    assert got.dtype == x.dtype and got.shape == want.shape and got.is_contiguous()
    sums = x.double().abs() @ weight.double().abs().T * x.shape[1] * 2**-23
    tol = want.abs() * 2.0 ** -BITS[x.dtype] + sums + 1e-6
    assert ((got.double() - want).abs() <= tol).all(), float(((got.double() - want).abs() - tol).max())


@needs_gemm
@settings(max_examples=40, deadline=None)
@given(
    m=st.sampled_from([1, 2, 5, 95, 96, 97, 200]),
    k=st.sampled_from([1, 15, 16, 17, 72, 384]),
    n=st.sampled_from([1, 15, 63, 64, 65, 130]),
    activation=st.sampled_from(["none", "gelu", "residual"]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(DTYPES),
)
def test_one_rounding_from_the_exact_result(m, k, n, activation, bias, seed, dtype):
    x, weight, b, residual = problem(m, k, n, seed, bias, dtype)
    blocks, padded = kernels.gemm_blocks(weight, b)
    add = residual if activation == "residual" else None
    act = "gelu" if activation == "gelu" else "none"
    got = kernels.linear_widened_cpu(x, blocks, padded, n, act, add)
    assert_one_rounding_from(got, exact(x, weight, b, act, add), x, weight)


@needs_gemm
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_a_strided_residual_are_read_in_place(dtype):
    x, weight, b, residual = problem(2 * 150, 40, 70, seed=1, dtype=dtype)
    blocks, padded = kernels.gemm_blocks(weight, b)
    got = kernels.linear_widened_cpu(x[::2], blocks, padded, 70, "none", residual[::2])
    assert torch.equal(got, kernels.linear_widened_cpu(x[::2].contiguous(), blocks, padded, 70, "none", residual[::2].contiguous()))
    assert_one_rounding_from(got, exact(x[::2], weight, b, "none", residual[::2]), x[::2], weight)


@needs_gemm
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_bitwise_independent_of_the_other_rows_and_of_the_thread_count(dtype):
    x, weight, b, _ = problem(300, 384, 200, seed=2, dtype=dtype)
    blocks, padded = kernels.gemm_blocks(weight, b)
    full = kernels.linear_widened_cpu(x, blocks, padded, 200, "gelu")
    for start, stop in ((0, 1), (37, 38), (95, 97), (100, 300), (250, 300)):
        assert torch.equal(kernels.linear_widened_cpu(x[start:stop], blocks, padded, 200, "gelu"), full[start:stop])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.linear_widened_cpu(x, blocks, padded, 200, "gelu"), full)
    finally:
        torch.set_num_threads(threads)


@needs_gemm
@pytest.mark.parametrize("dtype", DTYPES)
def test_no_rows_give_an_empty_result(dtype):
    _, weight, b, _ = problem(1, 8, 5, seed=3, dtype=dtype)
    blocks, padded = kernels.gemm_blocks(weight, b)
    got = kernels.linear_widened_cpu(torch.empty(0, 8, dtype=dtype), blocks, padded, 5)
    assert got.shape == (0, 5) and got.dtype == dtype


@needs_gemm
@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_round_to_even_as_torch_does(dtype):
    """x I + residual with the residual half a unit in x's last place: every sum lies exactly between two values of
    the dtype and must round to the even one, on whole 16-lane vectors and on a partial one (40 columns)."""
    g = torch.Generator().manual_seed(6)
    n, step = 40, 2.0 ** -BITS[dtype]  # in [1, 2) one unit in the last place is 2 * step
    x = (1 + torch.randint(1, 2 ** (BITS[dtype] - 1) - 1, (64, n), generator=g) * 2 * step).to(dtype)  # in (1, 2)
    residual = (torch.randint(0, 2, (64, n), generator=g) * 2 - 1).to(dtype) * step
    blocks, padded = kernels.gemm_blocks(torch.eye(n, dtype=dtype), None)
    got = kernels.linear_widened_cpu(x, blocks, padded, n, "none", residual)
    want = (x.float() + residual.float()).to(dtype)  # torch rounds to nearest even
    assert ((x.float() + residual.float()).to(torch.float64) != want.double()).all()  # every sum is a tie
    assert torch.equal(got, want)


@needs_gemm
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_is_exact_gelu_in_the_tails_and_keeps_nan(dtype):
    """erf by Abramowitz-Stegun: large |x| give x and 0 as they should; a NaN stays a NaN."""
    weight = torch.ones(1, 1, dtype=dtype)  # one value per row: a NaN reaches its own row only
    big = torch.finfo(dtype).max / 2
    x = torch.tensor([-30.0, -6.0, -3.0, -1.0, -0.1, 0.0, 0.1, 1.0, 3.0, 6.0, 30.0, big, -big, float("nan"), 2.5, -2.5])
    x = x.to(dtype)[:, None]
    blocks, padded = kernels.gemm_blocks(weight, None)
    got = kernels.linear_widened_cpu(x, blocks, padded, 1, "gelu")[:, 0]
    want = torch.nn.functional.gelu(x.double())[:, 0]
    finite = ~want.isnan()
    assert torch.isnan(got[13]) and finite.sum() == 15
    assert ((got.double() - want)[finite].abs() <= want[finite].abs() * 2.0 ** -BITS[dtype] + 1e-6).all()


@needs_gemm
def test_bad_arguments_are_refused_with_what_was_expected():
    x, weight, b, residual = problem(10, 32, 20, seed=4)
    blocks, padded = kernels.gemm_blocks(weight, b)
    op = torch.ops.xenc_lab.linear_widened
    with pytest.raises(RuntimeError, match="bfloat16 or float16 x, got Float"):
        op(x.float(), blocks, padded, 20, "none", None)
    with pytest.raises(RuntimeError, match="2-D BFloat16"):
        op(x[None], blocks, padded, 20, "none", None)
    with pytest.raises(RuntimeError, match="float32 blocks"):
        op(x[:, :16], blocks, padded, 20, "none", None)
    with pytest.raises(RuntimeError, match="does not fit"):
        op(x, blocks, padded, 65, "none", None)
    with pytest.raises(RuntimeError, match='"none" or "gelu"'):
        op(x, blocks, padded, 20, "relu", None)
    with pytest.raises(RuntimeError, match="plain product"):
        op(x, blocks, padded, 20, "gelu", residual)
    with pytest.raises(RuntimeError, match="residual must be"):
        op(x, blocks, padded, 20, "none", residual[:, :10])
    with pytest.raises(RuntimeError, match="residual must be"):
        op(x, blocks, padded, 20, "none", residual.half())


@needs_gemm
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_op_is_registered_for_tracing(dtype):
    x, weight, b, residual = problem(33, 48, 70, seed=5, dtype=dtype)
    blocks, padded = kernels.gemm_blocks(weight, b)
    torch.library.opcheck(torch.ops.xenc_lab.linear_widened.default, (x, blocks, padded, 70, "none", residual))
    torch.library.opcheck(torch.ops.xenc_lab.linear_widened.default, (x, blocks, padded, 70, "gelu", None))


@needs_gemm
def test_the_self_check_turns_away_a_wrong_layout(monkeypatch):
    """``widened_gemm_available`` computes a problem both ways: a weight packed as W rather than W^T blocks is
    caught."""
    real = kernels.gemm_blocks

    def untransposed(weight, bias):
        blocks, padded = real(weight, bias)
        return blocks.transpose(1, 2).contiguous().view(blocks.shape), padded

    monkeypatch.setattr(kernels, "gemm_blocks", untransposed)
    assert kernels._widened_gemm_check() is False
    monkeypatch.setattr(kernels, "gemm_blocks", real)
    assert kernels._widened_gemm_check() is True


def layer_of(dtype: torch.dtype, in_features: int, out_features: int) -> torch.nn.Linear:
    if dtype == torch.float16 and onednn_fp16():
        pytest.skip("oneDNN multiplies float16 on this CPU: float16 layers stay torch's")
    return torch.nn.Linear(in_features, out_features).to(dtype).requires_grad_(False)


@needs_gemm
@pytest.mark.parametrize("dtype", DTYPES)
def test_prepacked_linear_takes_it_where_16_bit_products_run_in_fp32(dtype):
    """Same numbers as the fp32 GEMM through torch's ops (widen, oneDNN, round) but for the order of the fp32
    sums; the layer keeps only its own blocked weight."""
    torch.manual_seed(0)
    linear = layer_of(dtype, 384, 320)
    x, residual = torch.randn(300, 384, dtype=dtype), torch.randn(300, 320, dtype=dtype)
    fused = PrepackedLinear(linear, gemm="fp32")
    through_torch = PrepackedLinear(linear, gemm="fp32", fused=False)
    assert fused.fused and not through_torch.fused and fused.packed.shape == (5, 384, 64)
    if dtype == torch.bfloat16 and onednn_bf16():
        assert not PrepackedLinear(linear, gemm="native").fused  # native bf16 GEMMs stay oneDNN's
    for call in (lambda m: m(x), lambda m: m(x, activation="gelu"), lambda m: m(x, residual=residual),
                 lambda m: m.rows(64, 320)(x), lambda m: m(x.view(3, 100, 384)),
                 lambda m: m(x, residual=residual.t().contiguous().t())):  # column-strided residual
        a, b = call(through_torch), call(fused)
        assert a.shape == b.shape and b.dtype == dtype
        assert (a == b).double().mean() > 0.99
        assert ((a.double() - b.double()).abs() <= a.double().abs() * 2.0 ** (1 - BITS[dtype]) + 1e-30).all()
    assert fused.rows(64, 320).fused


@needs_gemm
def test_float16_layers_take_the_fp32_route_whatever_is_asked():
    """fp16 products are exact in fp32; neither oneDNN's bf16 GEMM nor the fp16 one of bf16 layers applies."""
    linear = layer_of(torch.float16, 32, 48)
    for gemm in (None, "native", "fp32", "fp16"):
        layer = PrepackedLinear(linear, gemm=gemm)
        assert layer.gemm == "fp32" and layer.fused and layer.packed.dtype == torch.float32


@pytest.mark.parametrize("onednn", [False, True])
def test_fp16_layers_are_prepacked_where_onednn_has_no_fp16_gemm(monkeypatch, onednn):
    """Without oneDNN's fp16 GEMM (CPUs without AVX512-FP16 or AMX-FP16) torch's fp16 matmul runs through
    conversions; there fp16 layers take the fp32 route (exact fp16 products, fp32 sums, one rounding). Where oneDNN
    multiplies fp16 they stay torch's."""
    monkeypatch.setattr("xenc_lab.layers.onednn_fp16", lambda: onednn)
    assert PrepackedLinear.supported(torch.float16, torch.device("cpu")) is not onednn
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(384, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    model = model.half().requires_grad_(False)
    x = torch.randn(300, 384, dtype=torch.float16)
    want = model(x)
    assert prepack_linears(model) == (0 if onednn else 2)
    if not onednn:
        layer = model[0]
        assert isinstance(layer, PrepackedLinear) and layer.gemm == "fp32" and layer.weight.dtype == torch.float16
        exact = x.double() @ layer.weight.double().T + layer.bias.double()
        got = layer(x)
        assert got.dtype == torch.float16
        assert (got == exact.half()).double().mean() > 0.99  # correctly rounded but for the fp32 sums' order
        assert ((got.double() - exact).abs() <= exact.abs() * 2**-10 + 1e-3).all()
    got = model(x)
    assert got.dtype == torch.float16 and ((got.double() - want.double()).abs() <= want.double().abs() * 2**-8 + 2e-3).all()


@needs_gemm
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_it_stays_one_op_on_16_bit_tensors(dtype):
    """Under torch.compile the layer is the opaque prepacked op on 16-bit tensors in and out (no widening around
    it), and computes what it computes eagerly."""
    torch.manual_seed(1)
    linear = PrepackedLinear(layer_of(dtype, 64, 96), gemm="fp32")
    assert linear.fused
    assert_compiled_as_one_op(linear, dtype)


def assert_compiled_as_one_op(linear: PrepackedLinear, dtype: torch.dtype = torch.bfloat16) -> None:
    """Compiled, ``linear`` (64 -> 96, of dtype) computes what it computes eagerly, in one opaque op with no casts."""
    x, residual = torch.randn(50, 64, dtype=dtype), torch.randn(50, 96, dtype=dtype)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, r: linear(x, residual=r), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x, residual), linear(x, residual=residual))
    graphs = []
    torch._dynamo.reset()
    torch.compile(lambda x: linear(x, activation="gelu"), backend=lambda gm, _: graphs.append(gm) or gm, fullgraph=True)(x)
    ops = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert torch.ops.xenc_lab.prepacked_linear.default in ops
    assert not any("to" in str(op) or "_to_copy" in str(op) for op in ops), ops


@pytest.mark.parametrize("dtype", DTYPES)
def test_asked_for_where_it_does_not_run_the_layer_takes_torch_s_ops(monkeypatch, dtype):
    monkeypatch.setattr("xenc_lab.layers.widened_gemm_available", lambda: False)
    torch.manual_seed(2)
    linear = layer_of(dtype, 32, 48)
    layer = PrepackedLinear(linear, gemm="fp32", fused=True)
    assert not layer.fused and layer.gemm == "fp32"
    x = torch.randn(20, 32, dtype=dtype)
    assert ((layer(x).double() - linear(x).double()).abs() <= linear(x).double().abs() * 2.0 ** (1 - BITS[dtype]) + 1e-30).all()
