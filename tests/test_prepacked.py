"""PrepackedLinear: the CPU's prepacked GEMMs give torch's products (to the bit where the arithmetic is the same),
on every GEMM route, with their GELU and residual inside; the routes are read from the CPU or the environment."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from xenc_lab.batch import pack
from xenc_lab.choices import resolve
from xenc_lab.cpu.gemm import onednn_bf16
from xenc_lab.cpu.info import CpuInfo
from xenc_lab.cpu.prepacked import PrepackedLinear, prepack_linears
from xenc_lab.ops.first_token import split_first
from xenc_lab.ops.linear import linear_plus
from xenc_lab.tokenize import Encodings


def cpu_choices(dtype: torch.dtype):
    """The choices a Scorer at ``dtype`` on this CPU makes (the GEMM routes among them)."""
    return resolve(torch.device("cpu"), dtype, None, False)


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
    choices = cpu_choices(dtype)
    assert prepack_linears(model, choices) == 2 and isinstance(model[0], PrepackedLinear)
    torch.testing.assert_close(model(x), want, atol=1e-6, rtol=1e-6)  # float32: rounding may differ from MKL's
    assert prepack_linears(model, choices) == 0  # nothing left to prepack


def test_prepack_linears_keeps_the_linears_it_is_told_to():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    kept = model[1]
    assert prepack_linears(model, cpu_choices(torch.float32), keep=[kept]) == 1
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
    from xenc_lab.cpu.gemm import bf16_gemm
    from xenc_lab.cpu.kernels import half_gemm_available

    runs = {"native": onednn_bf16(), "fp32": True, "fp16": half_gemm_available()}
    for choice in ("native", "fp32", "fp16"):  # a forced route that cannot run here takes fp32
        monkeypatch.setenv("XENC_LAB_BF16_GEMM", choice.upper())
        assert bf16_gemm() == (choice if runs[choice] else "fp32")
    monkeypatch.setenv("XENC_LAB_BF16_GEMM", "fast")
    with pytest.raises(ValueError, match="XENC_LAB_BF16_GEMM must be one of native, fp32, fp16, got 'fast'"):
        bf16_gemm()
    monkeypatch.delenv("XENC_LAB_BF16_GEMM")
    monkeypatch.setattr("xenc_lab.cpu.gemm.onednn_bf16", lambda: False)  # AVX2-only CPUs, whoever made them
    for vendor in ("GenuineIntel", "AuthenticAMD"):
        monkeypatch.setattr("xenc_lab.cpu.gemm.cpu_info", lambda v=vendor: CpuInfo(v, "cpu", frozenset({"avx2"})))
        assert bf16_gemm() == "fp32"
    monkeypatch.setattr("xenc_lab.cpu.gemm.onednn_bf16", lambda: True)
    monkeypatch.setattr("xenc_lab.cpu.gemm.cpu_info", lambda: CpuInfo("GenuineIntel", "Xeon", frozenset({"avx512_bf16"})))
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    for half in (True, False):  # Intel without AMX: the fp16 GEMM where it runs, else fp32 products
        monkeypatch.setattr("xenc_lab.cpu.gemm.half_gemm_available", lambda h=half: h)
        assert bf16_gemm() == ("fp16" if half else "fp32")
    for vendor, flags in (("GenuineIntel", {"avx512_bf16", "amx_bf16"}), ("AuthenticAMD", {"avx512_bf16"})):
        monkeypatch.setattr("xenc_lab.cpu.gemm.cpu_info", lambda v=vendor, f=flags: CpuInfo(v, "cpu", frozenset(f)))
        assert bf16_gemm() == "native"


@pytest.mark.parametrize("onednn", [False, True])
def test_bf16_layers_without_onednn_bf16_take_the_fp32_route(monkeypatch, onednn):
    """Where oneDNN has no bf16 GEMM (AVX2-only CPUs), a bf16 layer is still prepacked, on the fp32 route even when
    "native" is asked: exact bf16 products, fp32 sums, one rounding to bf16, the numbers of a bf16 GEMM but for the
    order of the fp32 sums."""
    if onednn and not onednn_bf16():
        pytest.skip("needs oneDNN bfloat16 on this CPU")
    monkeypatch.setattr("xenc_lab.cpu.prepacked.onednn_bf16", lambda: onednn)
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
    for call, added in ((lambda m: m(x), None), (lambda m: m(x, activation="gelu"), None),
                        (lambda m: m(x, residual=residual), residual), (lambda m: m.rows(128, 256)(x), None)):
        a, b = call(native), call(wide)
        assert b.dtype == torch.bfloat16 and a.shape == b.shape
        assert (a == b).double().mean() > 0.999
        # one bf16 step (8-bit significand) of the result, or of the product where a residual cancels it (AMX's
        # bf16 GEMM rounds the product before its residual post-op)
        product = a.double() if added is None else a.double() - added.double()
        largest = torch.maximum(a.double().abs(), product.abs())
        step = largest.clamp_min(1e-30) * 2**-7
        assert ((a.double() - b.double()).abs() <= step).all()
    assert wide.rows(128, 256).gemm == "fp32"


def test_fp32_layers_ignore_the_bf16_gemm_and_a_bad_one_is_refused():
    linear = torch.nn.Linear(8, 4).requires_grad_(False)
    assert PrepackedLinear(linear, gemm="fp16").gemm == PrepackedLinear(linear, gemm="fp32").gemm == "native"
    with pytest.raises(ValueError, match="gemm must be None or one of native, fp32, fp16, got 'int8'"):
        PrepackedLinear(linear, gemm="int8")

