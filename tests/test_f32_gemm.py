"""xenc_lab's fp32 GEMMs (ATen's fp32 brgemm with the bias, GELU or residual applied to each output tile in cache):
``kernels.linear_f32_cpu`` for float32 layers, and ``kernels.linear_widened_cpu`` for bf16 and fp16 layers whose
products run in fp32 (x widened a block at a time in cache, one rounding to x's dtype at the end). Both against
float64, and as ``PrepackedLinear``'s paths."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xenc_lab.choices import resolve
from xenc_lab.cpu import gemm, kernels, native
from xenc_lab.cpu.gemm import onednn_bf16, onednn_fp16
from xenc_lab.cpu.info import CpuInfo
from xenc_lab.cpu.prepacked import PrepackedLinear, prepack_linears

# Built is enough to run the ops' own tests: a build whose self-check fails must fail them, not skip them.
needs_gemm = pytest.mark.skipif(
    not native.available() or not torch.ops.xenc_lab.gemm_f32_built(),
    reason="xenc_lab's fp32 GEMMs are not built here (need AVX2 and FMA or AVX-512, and a torch with cpublas' fp32 "
    "brgemm)",
)
DTYPES = [torch.bfloat16, torch.float16]  # linear_widened's
ALL_DTYPES = [torch.float32, *DTYPES]
# Significant bits after the rounding to each dtype.
BITS = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}


def linear(dtype: torch.dtype):
    """The op for x of dtype: ``linear_f32_cpu`` for float32, ``linear_widened_cpu`` for bf16 and fp16."""
    return kernels.linear_f32_cpu if dtype == torch.float32 else kernels.linear_widened_cpu


@needs_gemm
def test_it_runs_wherever_it_is_built():
    """Built means AVX2 and FMA (or AVX-512) and ATen's fp32 brgemm: there both self-checks pass, and float32 GELU
    layers, and bf16 and fp16 layers whose products run in fp32, can take these GEMMs (a faulty build would otherwise
    quietly fall back to torch's ops)."""
    assert kernels.f32_gemm_available() and kernels.widened_gemm_available()


def problem(m: int, k: int, n: int, seed: int, bias: bool = True, dtype: torch.dtype = torch.float32):
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


def assert_rounded_from_exact(got: torch.Tensor, x, weight, bias, activation: str = "none", residual=None) -> None:
    """Within the float32 sums' error bound (k terms) and erf's (1.5e-7) of the exact result, and one rounding to x's
    dtype: a float32 rounding of the result for float32 (erf's error relative to the product before the GELU), one
    to bf16 or fp16 for those."""
    want = exact(x, weight, bias, activation, residual)
    assert got.dtype == x.dtype and got.shape == want.shape and got.is_contiguous()
    magnitudes = x.double().abs() @ weight.double().abs().T
    if x.dtype == torch.float32:
        product = exact(x, weight, bias, "none")
        tol = want.abs() * 2**-23 + product.abs() * 1e-7 + 1.2 * magnitudes * (x.shape[1] + 2) * 2**-24 + 1e-7
    else:
        tol = want.abs() * 2.0 ** -BITS[x.dtype] + magnitudes * x.shape[1] * 2**-23 + 1e-6
    assert ((got.double() - want).abs() <= tol).all(), float(((got.double() - want).abs() - tol).max())


@needs_gemm
@settings(max_examples=60, deadline=None)
@given(
    m=st.sampled_from([1, 2, 5, 95, 96, 97, 200]),
    k=st.sampled_from([1, 15, 16, 17, 72, 384]),
    n=st.sampled_from([1, 15, 63, 64, 65, 130]),
    activation=st.sampled_from(["none", "gelu", "residual"]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(ALL_DTYPES),
)
def test_one_rounding_from_the_exact_result(m, k, n, activation, bias, seed, dtype):
    x, weight, b, residual = problem(m, k, n, seed, bias, dtype)
    blocks, padded = kernels.gemm_blocks(weight, b)
    add = residual if activation == "residual" else None
    act = "gelu" if activation == "gelu" else "none"
    got = linear(dtype)(x, blocks, padded, n, act, add)
    assert_rounded_from_exact(got, x, weight, b, act, add)


@needs_gemm
def test_gelu_equals_torch_gelu_after_the_product_within_float32_rounding():
    """What sentence-transformers computes: a float32 product, then torch's GELU (the same erf approximation)."""
    x, weight, b, _ = problem(300, 384, 1536, seed=6)
    blocks, padded = kernels.gemm_blocks(weight, b)
    got = kernels.linear_f32_cpu(x, blocks, padded, 1536, "gelu")
    theirs = torch.nn.functional.gelu(torch.nn.functional.linear(x, weight, b))
    assert (got - theirs).abs().max() <= 2e-5  # products of ~40 here: float32 sums differ by ~1e-5 in order alone


@needs_gemm
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_strided_rows_and_a_strided_residual_are_read_in_place(dtype):
    x, weight, b, residual = problem(2 * 150, 40, 70, seed=1, dtype=dtype)
    blocks, padded = kernels.gemm_blocks(weight, b)
    got = linear(dtype)(x[::2], blocks, padded, 70, "none", residual[::2])
    assert torch.equal(got, linear(dtype)(x[::2].contiguous(), blocks, padded, 70, "none", residual[::2].contiguous()))
    assert_rounded_from_exact(got, x[::2], weight, b, "none", residual[::2])


@needs_gemm
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_rows_are_bitwise_independent_of_the_other_rows_and_of_the_thread_count(dtype):
    x, weight, b, _ = problem(300, 384, 200, seed=2, dtype=dtype)
    blocks, padded = kernels.gemm_blocks(weight, b)
    full = linear(dtype)(x, blocks, padded, 200, "gelu")
    for start, stop in ((0, 1), (37, 38), (95, 97), (100, 300), (250, 300)):
        assert torch.equal(linear(dtype)(x[start:stop], blocks, padded, 200, "gelu"), full[start:stop])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(dtype)(x, blocks, padded, 200, "gelu"), full)
    finally:
        torch.set_num_threads(threads)


@needs_gemm
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_no_rows_give_an_empty_result(dtype):
    _, weight, b, _ = problem(1, 8, 5, seed=3, dtype=dtype)
    blocks, padded = kernels.gemm_blocks(weight, b)
    got = linear(dtype)(torch.empty(0, 8, dtype=dtype), blocks, padded, 5)
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
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_gelu_is_exact_gelu_in_the_tails_and_keeps_nan(dtype):
    """erf by Abramowitz-Stegun: large |x| give x and 0 as they should; a NaN stays a NaN."""
    weight = torch.ones(1, 1, dtype=dtype)  # one value per row: a NaN reaches its own row only
    big = torch.finfo(dtype).max / 2
    x = torch.tensor([-30.0, -6.0, -3.0, -1.0, -0.1, 0.0, 0.1, 1.0, 3.0, 6.0, 30.0, big, -big, float("nan"), 2.5, -2.5])
    x = x.to(dtype)[:, None]
    blocks, padded = kernels.gemm_blocks(weight, None)
    got = linear(dtype)(x, blocks, padded, 1, "gelu")[:, 0]
    want = torch.nn.functional.gelu(x.double())[:, 0]
    finite = ~want.isnan()
    assert torch.isnan(got[13]) and finite.sum() == 15
    x = x.double()[:, 0]  # erf's error, relative to the product, is what float32 sees; 16 bits round it away
    if dtype == torch.float32:
        tol = want.abs() * 2**-22 + x.abs() * 1e-7
    else:
        tol = want.abs() * 2.0 ** -BITS[dtype] + 1e-6
    assert ((got.double() - want)[finite].abs() <= tol[finite]).all()


@needs_gemm
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_bad_arguments_are_refused_with_what_was_expected(dtype):
    x, weight, b, residual = problem(10, 32, 20, seed=4, dtype=dtype)
    blocks, padded = kernels.gemm_blocks(weight, b)
    name = {torch.float32: "Float", torch.bfloat16: "BFloat16", torch.float16: "Half"}[dtype]
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    if dtype == torch.float32:
        op, wrong_x, wrong_x_says = torch.ops.xenc_lab.linear_f32, x.bfloat16(), "2-D Float CPU tensor, got BFloat16"
    else:
        op, wrong_x, wrong_x_says = torch.ops.xenc_lab.linear_widened, x.float(), "bfloat16 or float16 x, got Float"
    for args, says in (
        ((wrong_x, blocks, padded, 20, "none", None), wrong_x_says),
        ((x[None], blocks, padded, 20, "none", None), rf"2-D {name} CPU tensor, got {name} of shape \[1, 10, 32\]"),
        ((x[:, :16], blocks, padded, 20, "none", None), "float32 blocks"),
        ((x, blocks, padded, 65, "none", None), "does not fit"),
        ((x, blocks, padded, 20, "relu", None), '"none" or "gelu"'),
        ((x, blocks, padded, 20, "gelu", residual), "plain product"),
        ((x, blocks, padded, 20, "none", residual[:, :10]), rf"residual must be a {name} \(10, 20\) tensor"),
        ((x, blocks, padded, 20, "none", residual.to(other)), "residual must be"),
    ):
        with pytest.raises(RuntimeError, match=says):
            op(*args)


@needs_gemm
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_the_op_is_registered_for_tracing(dtype):
    x, weight, b, residual = problem(33, 48, 70, seed=5, dtype=dtype)
    blocks, padded = kernels.gemm_blocks(weight, b)
    op = torch.ops.xenc_lab.linear_f32 if dtype == torch.float32 else torch.ops.xenc_lab.linear_widened
    torch.library.opcheck(op.default, (x, blocks, padded, 70, "none", residual))
    torch.library.opcheck(op.default, (x, blocks, padded, 70, "gelu", None))


@needs_gemm
@pytest.mark.parametrize("check", [kernels._f32_gemm_check, kernels._widened_gemm_check])
def test_the_self_checks_turn_away_a_wrong_layout(monkeypatch, check):
    """``f32_gemm_available`` and ``widened_gemm_available`` compute a problem both ways: a weight packed as W rather
    than W^T blocks is caught."""
    real = kernels.gemm_blocks

    def untransposed(weight, bias):
        blocks, padded = real(weight, bias)
        return blocks.transpose(1, 2).contiguous().view(blocks.shape), padded

    monkeypatch.setattr(kernels, "gemm_blocks", untransposed)
    assert check() is False
    monkeypatch.setattr(kernels, "gemm_blocks", real)
    assert check() is True


def test_the_choice_is_measured_cpus_only_and_can_be_forced(monkeypatch):
    """``fused`` by default only where it was measured faster (x86 without AVX-512) and where it runs; the variable
    forces either way, ``fused`` falling back where it cannot run."""
    monkeypatch.delenv("XENC_LAB_F32_GELU_GEMM", raising=False)
    monkeypatch.setattr(gemm, "f32_gemm_available", lambda: True)
    monkeypatch.setattr(gemm, "cpu_info", lambda: CpuInfo("AuthenticAMD", "AMD EPYC", frozenset({"avx2", "fma"})))
    assert gemm.f32_gelu_gemm() == "fused"
    monkeypatch.setattr(gemm, "cpu_info", lambda: CpuInfo("GenuineIntel", "Xeon", frozenset({"avx2", "avx512f"})))
    assert gemm.f32_gelu_gemm() == "onednn"
    monkeypatch.setenv("XENC_LAB_F32_GELU_GEMM", "fused")
    assert gemm.f32_gelu_gemm() == "fused"
    monkeypatch.setattr(gemm, "f32_gemm_available", lambda: False)
    assert gemm.f32_gelu_gemm() == "onednn"
    monkeypatch.setenv("XENC_LAB_F32_GELU_GEMM", "sometimes")
    with pytest.raises(ValueError, match="XENC_LAB_F32_GELU_GEMM must be one of fused, onednn"):
        gemm.f32_gelu_gemm()


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


@pytest.mark.slow
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
    for route in (None, "native", "fp32", "fp16"):
        layer = PrepackedLinear(linear, gemm=route)
        assert layer.gemm == "fp32" and layer.fused and layer.packed.dtype == torch.float32


@pytest.mark.parametrize("onednn", [False, True])
def test_fp16_layers_are_prepacked_where_onednn_has_no_fp16_gemm(monkeypatch, onednn):
    """Without oneDNN's fp16 GEMM (CPUs without AVX512-FP16 or AMX-FP16) torch's fp16 matmul runs through
    conversions; there fp16 layers take the fp32 route (exact fp16 products, fp32 sums, one rounding). Where oneDNN
    multiplies fp16 they stay torch's."""
    monkeypatch.setattr("xenc_lab.cpu.prepacked.onednn_fp16", lambda: onednn)
    assert PrepackedLinear.supported(torch.float16, torch.device("cpu")) is not onednn
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(384, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    model = model.half().requires_grad_(False)
    x = torch.randn(300, 384, dtype=torch.float16)
    want = model(x)
    assert prepack_linears(model, resolve(torch.device("cpu"), torch.float16, None, False)) == (0 if onednn else 2)
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


@pytest.mark.slow
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
    monkeypatch.setattr("xenc_lab.cpu.prepacked.widened_gemm_available", lambda: False)
    torch.manual_seed(2)
    linear = layer_of(dtype, 32, 48)
    layer = PrepackedLinear(linear, gemm="fp32", fused=True)
    assert not layer.fused and layer.gemm == "fp32"
    x = torch.randn(20, 32, dtype=dtype)
    assert ((layer(x).double() - linear(x).double()).abs() <= linear(x).double().abs() * 2.0 ** (1 - BITS[dtype]) + 1e-30).all()
