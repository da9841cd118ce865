"""RowLayerNorm (the eager CPU LayerNorm of the packed models in bfloat16 and float16) and its kernel against
torch's LayerNorm on the same inputs."""
from __future__ import annotations

import pytest
import torch

from xenc_lab.cpu import native
from xenc_lab.cpu.norm import RowLayerNorm, row_layer_norms


def norms(d: int, dtype: torch.dtype, affine: str, seed: int) -> tuple[torch.nn.LayerNorm, torch.nn.LayerNorm]:
    """(torch's LayerNorm, the same made a RowLayerNorm), random parameters."""
    made = []
    for _ in range(2):
        norm = torch.nn.LayerNorm(d, eps=1e-5, bias=affine == "weight and bias", elementwise_affine=affine != "neither")
        with torch.no_grad():
            for p in norm.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
        made.append(norm.to(dtype))
    reference, fast = made
    if affine == "neither":
        fast.__class__ = RowLayerNorm  # row_layer_norms leaves norms without parameters alone; the kernel takes them
    else:
        assert row_layer_norms(fast) == 1 and isinstance(fast, RowLayerNorm)
    return reference, fast


@pytest.mark.skipif(not native.available(), reason="the native kernels could not be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [7, 16, 33, 384, 1000])
@pytest.mark.parametrize("affine", ["weight and bias", "weight only", "neither"])
def test_computes_what_torch_does(dtype, d, affine):
    """float32 within float32 rounding; 16-bit types equal but where that rounding crosses a rounding boundary of
    the dtype, and then one step of it away."""
    reference, fast = norms(d, dtype, affine, seed=d)
    x = (torch.randn(2 * 300, d, generator=torch.Generator().manual_seed(-d % 997)) * 3 + 1).to(dtype)[::2]  # strided rows
    expected, got = reference(x), fast(x)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    if dtype == torch.float32:
        assert torch.equal(got, expected), "float32 keeps torch's LayerNorm (parity measures its rounding)"
        got = torch.ops.xenc_lab.layer_norm(x, reference.weight, reference.bias, reference.eps)  # the kernel itself
        torch.testing.assert_close(got, expected, atol=4e-6, rtol=2e-6)
    else:
        step = torch.finfo(dtype).eps * expected.float().abs().clamp_min(1.0)
        assert ((got.float() - expected.float()).abs() <= step).all()
        assert (got == expected).double().mean() > 0.999
    assert not torch.equal(got, torch.nn.functional.layer_norm(x, (d,), reference.weight, reference.bias, 1e-3)), (
        "eps is read"
    )


@pytest.mark.skipif(not native.available(), reason="the native kernels could not be built here")
def test_a_row_of_one_is_its_bias_exactly():
    _, fast = norms(1, torch.bfloat16, "weight and bias", seed=3)
    x = torch.randn(50, 1).bfloat16()
    assert torch.equal(fast(x), fast.bias.expand(50, 1))  # x - mean is exactly 0


@pytest.mark.slow
def test_torch_s_where_the_kernel_does_not_apply(monkeypatch):
    norm = torch.nn.LayerNorm(8).bfloat16()
    row_layer_norms(norm)
    x3 = torch.randn(2, 5, 8).bfloat16()  # not a (T, d) stream
    assert torch.equal(norm(x3), torch.nn.functional.layer_norm(x3, (8,), norm.weight, norm.bias))
    columns = torch.randn(8, 5).bfloat16().t()  # strided columns
    assert torch.equal(norm(columns), torch.nn.functional.layer_norm(columns, (8,), norm.weight, norm.bias))
    mixed = torch.nn.LayerNorm(8)  # float32 parameters on a bfloat16 stream (autocast): torch's mixed-type norm
    mixed.__class__ = RowLayerNorm
    x = torch.randn(5, 8).bfloat16()
    assert torch.equal(mixed(x), torch.nn.functional.layer_norm(x, (8,), mixed.weight, mixed.bias))
    monkeypatch.setattr("xenc_lab.cpu.norm.layer_norm_cpu", lambda *args: None)  # the kernel not built
    x = torch.randn(5, 8).bfloat16()
    assert torch.equal(norm(x), torch.nn.functional.layer_norm(x, (8,), norm.weight, norm.bias))
    compiled = torch.compile(norm, fullgraph=True)  # inductor's own LayerNorm, fused with its neighbours
    torch.testing.assert_close(compiled(x), norm(x))


@pytest.mark.skipif(not native.available(), reason="the native kernels could not be built here")
def test_bad_operands_are_refused():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="2-D"):
        torch.ops.xenc_lab.layer_norm(x[None], None, None, 1e-5)
    with pytest.raises(RuntimeError, match="weight and bias"):
        torch.ops.xenc_lab.layer_norm(x, torch.ones(7), None, 1e-5)
    with pytest.raises(RuntimeError, match="weight and bias"):
        torch.ops.xenc_lab.layer_norm(x, torch.ones(8).bfloat16(), None, 1e-5)
    with pytest.raises(RuntimeError, match="float32, bfloat16 and float16"):
        torch.ops.xenc_lab.layer_norm(x.double(), None, None, 1e-5)
    assert torch.ops.xenc_lab.layer_norm(torch.empty(0, 8), None, None, 1e-5).shape == (0, 8)
