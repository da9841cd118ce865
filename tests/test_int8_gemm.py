"""The int8 linear layer (cpu/int8.py, cpu/int8_math.py, csrc/gemm_int8.cpp): its quantization, both routes
against each other and against float arithmetic, output rows, GELU and residual, a decoder's gated gate/up layer,
the calls that run two layers or end in a LayerNorm, and the Choices it implies."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from xenc_lab import choices as engine_choices
from xenc_lab.config import ScorerConfig
from xenc_lab.cpu.int8 import Int8Linear, int8_kernel_available, int8_mlp_available, int8_norm_available
from xenc_lab.cpu.int8_math import (
    ROTATION, gated_order, hadamard_rows, int_products, quantize_rows, quantize_weight,
)

needs_kernel = pytest.mark.skipif(not int8_kernel_available(), reason="the int8 kernel does not run here")


def _layer(n: int, k: int, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n).requires_grad_(False)


def test_the_kernel_runs_where_the_cpu_has_int8_dot_products():
    """The self-check falls back to the torch route on a wrong result: on a CPU with AVX512-VNNI or AMX-INT8 (what
    ATen's int8 brgemm asks of oneDNN) or AVX-VNNI (the kernel's own products), and a build with the brgemm, that
    fallback would hide a broken kernel, so it fails here; so would the own products hiding a broken brgemm call
    where ATen runs it."""
    from xenc_lab.cpu.info import cpu_info
    from xenc_lab.cpu.int8 import int8_products
    from xenc_lab.cpu.native import available

    flags = cpu_info().flags
    if not {"avx512_vnni", "avx_vnni", "amx_int8"} & flags:
        pytest.skip("no int8 dot-product units on this CPU")
    if not available() or not torch.ops.xenc_lab.int8_gemm_built():
        pytest.skip("this build has no int8 brgemm")
    assert int8_kernel_available()
    assert int8_products() == ("brgemm" if {"avx512_vnni", "amx_int8"} & flags else "own")


def test_weights_are_symmetric_per_output_channel_and_activations_keep_zero_exact():
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [3.0, 0.0, -3.0]])
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and q[0, 1] == -127 and q[2, 0] == 127 and q[2, 2] == -127
    assert torch.equal(q[1], torch.zeros(3, dtype=torch.int8)) and scale[1] == 0
    x = torch.tensor([[0.0, 1.0, 2.0, -0.5], [0.0, 0.0, 0.0, 0.0]])
    u, s, z = quantize_rows(x)
    assert u.dtype == torch.uint8 and u[0].max() == 255 and u[0].min() == 0
    assert torch.equal(u[:, 0].int(), z[:, 0].int())  # 0 is exactly the zero point
    assert ((u.float() - z) * s - x).abs().max() <= s.max() / 2 + 1e-7


@pytest.mark.parametrize("route", [pytest.param("kernel", marks=needs_kernel), "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 40, 24), (100, 74, 80), (130, 384, 200)])
def test_int8_layer_is_within_its_quantization_error_of_the_float_layer(route, dtype, shape):
    m, k, n = shape
    layer = _layer(n, k)
    x = torch.randn(m, k).to(dtype)
    exact = x.double() @ layer.weight.double().t() + layer.bias.double()
    q = Int8Linear(layer, route)
    assert q.route == route and q.weight is None
    y = q(x)
    assert y.dtype == dtype and y.shape == (m, n)
    # each term's error: half a step of x times |w| plus |x| times half a step of w
    _, xs, _ = quantize_rows(x)
    ws = layer.weight.abs().amax(dim=1) / 127
    bound = 0.5 * (xs * layer.weight.abs().sum(dim=1)[None] + x.float().abs() @ ws.expand(k, n))
    bound = bound + 2 * torch.finfo(dtype).eps * (1 + exact.abs().float())
    assert ((y.double() - exact).abs() <= bound.double() * 1.01).all()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_and_the_torch_route_agree_with_gelu_and_residual(dtype):
    layer = _layer(150, 96, seed=1)
    kernel, fallback = Int8Linear(layer, "kernel"), Int8Linear(layer, "torch")
    x, residual = torch.randn(70, 96).to(dtype), torch.randn(70, 150).to(dtype)
    _, xs, _ = quantize_rows(x)
    step = xs * layer.weight.abs().amax(dim=1)[None] * 1.1  # a tie may round either way: one step of x, once
    for args in ({"activation": "gelu"}, {"residual": residual}, {}):
        a, b = kernel(x, **args).float(), fallback(x, **args).float()
        assert ((a - b).abs() <= step + 2 * torch.finfo(dtype).eps * (1 + b.abs())).all(), args


@pytest.mark.parametrize("route", [pytest.param("kernel", marks=needs_kernel), "torch"])
@pytest.mark.parametrize("start, stop", [(0, 64), (64, 192), (10, 50), (128, 200)])
def test_output_rows_equal_the_columns_of_the_whole_product(route, start, stop):
    for k, rotate in ((64, False), (ROTATION, True)):
        layer = Int8Linear(_layer(200, k, seed=2), route, rotate=rotate)
        assert layer.rotation == (ROTATION if rotate else 0)
        x = torch.randn(33, k)
        assert torch.equal(layer.forward_rows(x, start, stop), layer(x)[:, start:stop]), rotate


def test_int8_choices_project_the_first_tokens_keys_and_values():
    cpu = torch.device("cpu")
    plain = engine_choices.resolve(cpu, torch.float32, (12, 32), False)
    int8 = engine_choices.resolve(cpu, torch.float32, (12, 32), False, quantization="int8")
    assert int8.quantization == "int8" and int8.first_token_kv == "projected" and plain.quantization is None


@pytest.mark.parametrize("value, error", [("int4", ValueError), (8, TypeError), ("", ValueError)])
def test_config_refuses_other_quantizations(value, error):
    with pytest.raises(error, match="quantization"):
        ScorerConfig(model="m", quantization=value)


def test_config_refuses_int8_off_the_cpu():
    with pytest.raises(ValueError, match="CPU only"):
        ScorerConfig(model="m", device="cuda", quantization="int8")
    assert ScorerConfig(model="m", quantization="int8").quantization == "int8"


@pytest.mark.parametrize("route", [pytest.param("kernel", marks=needs_kernel), "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gated_layer_computes_silu_of_the_gate_times_the_up_within_their_quantization(route, dtype):
    n, k = 96, 80  # 192 fused rows: gate rows 0..95, then up rows 96..191
    layer = _layer(2 * n, k, seed=3)
    x = torch.randn(50, k).to(dtype)
    gated, plain = Int8Linear(layer, route, gated=True), Int8Linear(layer, route)
    assert gated.route == plain.route == route
    y = gated(x, "silu_mul")
    assert y.dtype == dtype and y.shape == (50, n)
    gate, up = plain(x).float().chunk(2, dim=-1)  # the same int8 products, un-gated
    want = torch.nn.functional.silu(gate) * up
    # the plain layer rounds gate and up to dtype before silu * up; the gated one rounds once
    room = 4 * torch.finfo(dtype).eps * (gate.abs() * up.abs() + want.abs() + 1)
    assert ((y.float() - want).abs() <= room).all()
    exact_gate, exact_up = (x.double() @ layer.weight.double().t() + layer.bias.double()).chunk(2, dim=-1)
    exact = torch.nn.functional.silu(exact_gate) * exact_up
    assert (y.double() - exact).abs().max() <= 0.05 * exact.abs().max()  # int8's error, not a wrong layout's


def test_gated_order_puts_each_blocks_gate_rows_before_their_up_rows():
    order = gated_order(64)
    assert order[:32].tolist() == list(range(32)) and order[32:64].tolist() == list(range(64, 96))
    assert sorted(order.tolist()) == list(range(128))
    with pytest.raises(ValueError, match="multiple of 32"):
        gated_order(48)


def test_a_gated_layer_runs_silu_mul_only_and_whole():
    gated, plain = Int8Linear(_layer(128, 40), "torch", gated=True), Int8Linear(_layer(128, 40), "torch")
    x = torch.randn(3, 40)
    for layer, activation in ((gated, "none"), (gated, "gelu"), (plain, "silu_mul")):
        with pytest.raises(ValueError, match="silu_mul"):
            layer(x, activation)
    with pytest.raises(ValueError, match="runs whole"):
        gated.rows(0, 64)


def test_int8_decoders_gate_their_silu_mlps_and_score_as_ungated(monkeypatch):
    from parity_tests.conftest import model_dir
    from xenc_lab import Scorer
    from xenc_lab.cpu import int8
    from xenc_lab.zoo.corpus import corpus

    words = corpus()
    pairs = [(" ".join(words[i:i + 4]), " ".join(words[i + 5:i + 5 + 9 * (1 + i % 4)])) for i in range(0, 160, 10)]
    scorer = Scorer(model_dir("qwen3-reranker"), device="cpu", dtype="float32", quantization="int8")
    mlps = [m for m in scorer.engine.runner.model.modules() if isinstance(getattr(m, "gate_up", None), Int8Linear)]
    assert mlps and all(m.gate_up.gated for m in mlps)  # float32 keeps the first layer's at float32
    ours = torch.tensor(scorer.predict(pairs, show_progress_bar=False))
    monkeypatch.setattr(int8.Int8Linear, "__init__", _ungated(int8.Int8Linear.__init__))
    ungated = Scorer(model_dir("qwen3-reranker"), device="cpu", dtype="float32", quantization="int8")
    assert not any(getattr(m, "gated", False) for m in ungated.engine.runner.model.modules())
    theirs = torch.tensor(ungated.predict(pairs, show_progress_bar=False))
    assert theirs.std() > 0.1 and (ours - theirs).abs().max() <= 1e-4 * (theirs.max() - theirs.min())


def test_int8_on_torchs_ops_warns_that_it_is_slower_than_float32(tiny_dir, monkeypatch, recwarn):
    """Where ATen's int8 brgemm does not run (CPUs without AVX512-VNNI or AMX), int8 is correct but slower than
    float32: the user is told when the model loads."""
    from xenc_lab import Scorer, loader

    Scorer(str(tiny_dir), device="cpu", dtype="float32", quantization="int8")
    assert not [w for w in recwarn if "slower than float32" in str(w.message)] or loader.int8_route() == "torch"
    monkeypatch.setattr(loader, "int8_route", lambda: "torch")
    with pytest.warns(UserWarning, match="runs on torch's int8 ops on this CPU: correct, but slower than float32"):
        Scorer(str(tiny_dir), device="cpu", dtype="float32", quantization="int8")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_own_256_bit_products_compute_the_brgemms_outputs_to_the_bit(dtype):
    """The products CPUs with AVX-VNNI alone get (ATen's brgemm refuses them), run here on AVX512-VNNI's 256-bit
    form where the build has it: one and two layers, partial blocks of rows and columns, rotated or not, GELU, a
    residual, a gated layer and a LayerNorm at the end, against ATen's brgemm."""
    from xenc_lab.cpu.int8 import int8_products

    if not torch.ops.xenc_lab.int8_own_products(False):
        pytest.skip("this build has no 256-bit VNNI products (neither AVX-VNNI nor AVX512-VNNI with AVX512-VL)")
    assert int8_products() == "brgemm"  # ATen's where it runs
    g = torch.Generator().manual_seed(3)
    x = torch.randn(203, 256, generator=g).to(dtype)
    residual = torch.randn(203, 200, generator=g).to(dtype)
    rotated, plain = Int8Linear(_layer(200, 256, 1), "kernel", rotate=True), Int8Linear(_layer(200, 256, 2), "kernel")
    gated = Int8Linear(_layer(128, 256, 3), "kernel", gated=True)
    first, second = Int8Linear(_layer(256, 256, 4), "kernel", rotate=True), Int8Linear(_layer(200, 256, 5), "kernel")
    norm = nn.LayerNorm(200).to(dtype) if dtype != torch.float32 and int8_norm_available() else None
    calls = {
        "rotated, gelu": lambda: rotated._gemm(x, "gelu"),
        "plain, residual": lambda: plain._gemm(x, "none", residual),
        "gated": lambda: gated._gemm(x, "silu_mul"),
        "a few rows": lambda: plain._gemm(x[:5], "none"),
        "two layers": lambda: first.then(second, x, "gelu", residual, norm) if int8_mlp_available() else None,
    }
    try:
        for name, call in calls.items():
            theirs = call()
            torch.ops.xenc_lab.int8_own_products(True)
            ours = call()
            torch.ops.xenc_lab.int8_own_products(False)
            assert theirs is None or (theirs.float().std() > 0.1 and torch.equal(ours, theirs)), name
    finally:
        torch.ops.xenc_lab.int8_own_products(False)


def test_the_torch_routes_int32_sums_are_exact_where_one_float32_product_would_round():
    """The torch route's sums (and so the kernel's check) must be exact on every CPU: ``torch._int_mm`` saturates
    without AVX512-VNNI, and a float32 GEMM over all of k rounds past 2^24."""
    g = torch.Generator().manual_seed(5)
    u = torch.randint(200, 256, (7, 3072), generator=g).to(torch.uint8)
    z = torch.randint(0, 4, (7, 1), generator=g).float()
    w = torch.randint(100, 128, (3072, 65), generator=g).to(torch.int8)
    w[::3] = -w[::3]
    exact = (u.long() - z.long()) @ w.long()
    assert exact.abs().max() > 2**24  # where float32 cannot hold every sum
    assert not torch.equal(((u.float() - z) @ w.float()).long(), exact)
    assert torch.equal(int_products(u, z, w).long(), exact)
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")  # float32 GEMMs may take bf16 then: the sums go to float64
        assert torch.equal(int_products(u, z.flatten(), w).long(), exact)
    finally:
        torch.set_float32_matmul_precision(precision)


def _ungated(init):
    def plain(self, linear, route=None, gated=False, rotate=False):
        init(self, linear, route, rotate=rotate)
    return plain


def test_every_int8_layer_rotates_in_both_dtypes_and_only_per_pair_layers_stay_at_dtype():
    from xenc_lab import Scorer
    from xenc_lab.zoo import minilm_cross_encoder

    for dtype in ("float32", "bfloat16"):
        model = Scorer(minilm_cross_encoder(), device="cpu", dtype=dtype, quantization="int8").engine.runner.model
        layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
        assert layers and {m.rotation for m in layers} == {ROTATION}, dtype
        stack = next(m for m in model.modules() if isinstance(m, nn.ModuleList))
        assert any(isinstance(m, Int8Linear) for m in stack[0].modules()), dtype
        kept = {id(m) for m in model.per_pair_linears()}
        assert all(isinstance(m, Int8Linear) or id(m) in kept for m in model.modules() if type(m) is nn.Linear)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["gelu", "silu_mul"])
@pytest.mark.parametrize("rows, width, hidden, rotate", [(1, 64, 64, False), (7, 128, 200, True), (230, 256, 512, True),
                                                         (97, 72, 130, False)])
def test_two_int8_layers_run_together_compute_what_they_compute_one_at_a_time_to_the_bit(
        dtype, activation, rows, width, hidden, rotate):
    gated = activation == "silu_mul"
    if gated and hidden % 64:
        hidden += 64 - hidden % 64  # a gated layer is whole blocks of 64 columns
    first = Int8Linear(_layer(2 * hidden if gated else hidden, width, seed=5), "kernel", gated=gated, rotate=rotate)
    second = Int8Linear(_layer(width, hidden, seed=6), "kernel", rotate=rotate)
    torch.manual_seed(7)
    x, residual = (3 * torch.randn(rows, width)).to(dtype), torch.randn(rows, width).to(dtype)
    want = second(first(x, activation=activation), residual=residual)
    got = first.then(second, x, activation, residual)
    assert want.std() > 0 and torch.equal(got, want)
    assert torch.equal(first.then(second, x[:0], activation, residual[:0]), want[:0])


@needs_kernel
def test_the_two_layer_call_passes_its_check_where_the_kernel_runs():
    """A failed check runs the layers one at a time, which would hide a broken two-layer call: not where it runs."""
    assert int8_mlp_available()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, width, hidden", [(1, 64, 64), (7, 128, 200), (230, 384, 512), (97, 72, 130)])
def test_int8_calls_ending_in_a_layer_norm_compute_the_layer_norm_op_of_their_output_to_the_bit(
        dtype, rows, width, hidden):
    rotate = width % ROTATION == 0
    first = Int8Linear(_layer(hidden, width, seed=5), "kernel", rotate=rotate)
    second = Int8Linear(_layer(width, hidden, seed=6), "kernel", rotate=hidden % ROTATION == 0)
    norm = nn.LayerNorm(width).to(dtype).requires_grad_(False)
    torch.manual_seed(7)
    nn.init.normal_(norm.weight), nn.init.normal_(norm.bias)
    x, residual = (3 * torch.randn(rows, width)).to(dtype), torch.randn(rows, width).to(dtype)
    hidden_x = (3 * torch.randn(rows, hidden)).to(dtype)
    for got, before in [(first.then(second, x, "gelu", residual, norm), first.then(second, x, "gelu", residual)),
                        (second._gemm(hidden_x, "none", residual, norm), second._gemm(hidden_x, "none", residual))]:
        want = torch.ops.xenc_lab.layer_norm(before, norm.weight, norm.bias, norm.eps)
        assert want.float().std() > 0.5 and torch.equal(got, want)
    assert first.then(second, x[:0], "gelu", residual[:0], norm).shape == (0, width)


@needs_kernel
def test_the_calls_ending_in_a_norm_pass_their_check_where_the_kernel_runs():
    """A failed check runs the norms after the calls, which would hide a broken fused norm: not where it runs."""
    assert int8_norm_available()


def test_a_check_that_asks_for_another_checks_answer_first_does_not_wait_on_itself():
    """The norm's check asks for the two-layer call's, which asks for the kernel's: in a fresh process, nested."""
    import subprocess
    import sys

    code = "from xenc_lab.cpu.int8 import int8_norm_available as a, int8_kernel_available as k; print(a() == k())"
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.split()[-1] == "True", run.stderr[-2000:]


@needs_kernel
def test_then_refuses_layers_that_do_not_chain():
    first, second = Int8Linear(_layer(96, 64), "kernel"), Int8Linear(_layer(64, 80), "kernel")
    with pytest.raises(ValueError, match="chain"):
        first.then(second, torch.randn(4, 64), "gelu", None)
    with pytest.raises(ValueError, match="chain"):
        first.then(Int8Linear(_layer(64, 96), "torch"), torch.randn(4, 64), "gelu", None)


@needs_kernel
def test_an_int8_encoder_runs_each_ffn_as_one_kernel_call_and_scores_as_with_two(monkeypatch):
    from xenc_lab import Scorer
    from xenc_lab.models import bert
    from xenc_lab.zoo import minilm_cross_encoder

    pairs = [("how do caches work", "a cache keeps " + "recent results " * (i + 1)) for i in range(20)]
    scorer = Scorer(minilm_cross_encoder(), device="cpu", dtype="bfloat16", quantization="int8")
    calls = []
    then = Int8Linear.then
    monkeypatch.setattr(Int8Linear, "then", lambda self, *a: calls.append(self) or then(self, *a))
    together = torch.tensor(scorer.predict(pairs, show_progress_bar=False))
    assert len(set(map(id, calls))) == 5  # every layer's FFN but the last's, whose FFN sees one row per pair
    monkeypatch.setattr(bert, "int8_mlp", lambda *args: None)
    apart = torch.tensor(scorer.predict(pairs, show_progress_bar=False))
    assert together.std() > 0.1 and torch.equal(together, apart)


@needs_kernel
@pytest.mark.parametrize("model", ["minilm", "distilbert"])
def test_an_int8_encoders_layer_norms_run_inside_its_calls_and_score_as_after_them(model, monkeypatch, tmp_path):
    from xenc_lab import Scorer
    from xenc_lab.cpu.norm import RowLayerNorm
    from xenc_lab.ops import linear
    from xenc_lab.zoo import minilm_cross_encoder
    from xenc_lab.zoo.encoders import build_model

    path = minilm_cross_encoder() if model == "minilm" else build_model("distilbert", tmp_path)
    pairs = [("how do caches work", "a cache keeps " + "recent results " * (i + 1)) for i in range(20)]
    scorer = Scorer(path, device="cpu", dtype="bfloat16", quantization="int8")
    calls = []
    forward = RowLayerNorm.forward
    monkeypatch.setattr(RowLayerNorm, "forward", lambda self, x: calls.append(self) or forward(self, x))
    inside = torch.tensor(scorer.predict(pairs, show_progress_bar=False))
    run_by_torch = len(calls)
    monkeypatch.setattr(linear, "kernel_norm", lambda norm, x: False)
    calls.clear()
    after = torch.tensor(scorer.predict(pairs, show_progress_bar=False))
    # the embeddings' norm and the last layer's two (on one row per pair) run alone; every other layer's two inside
    assert run_by_torch == 3 and len(calls) > run_by_torch
    assert inside.std() > 0.1 and torch.equal(inside, after)


def test_hadamard_rows_multiply_each_block_by_the_sylvester_matrix():
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < ROTATION:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    x = torch.randn(5, 3 * ROTATION)
    want = (x.double().view(5, 3, ROTATION) @ h).view(5, -1)
    assert torch.allclose(hadamard_rows(x).double(), want, rtol=0, atol=1e-4)
    assert torch.allclose(hadamard_rows(hadamard_rows(x)), ROTATION * x, rtol=1e-5, atol=1e-4)  # H H = 128 I


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotated_the_kernel_and_the_torch_route_agree_and_stay_within_int8s_error(dtype):
    layer = _layer(150, 2 * ROTATION, seed=4)
    kernel, fallback = Int8Linear(layer, "kernel", rotate=True), Int8Linear(layer, "torch", rotate=True)
    assert kernel.rotation == fallback.rotation == ROTATION and "rotated" in repr(kernel)
    x, residual = torch.randn(70, 2 * ROTATION).to(dtype), torch.randn(70, 150).to(dtype)
    exact = x.double() @ layer.weight.double().t() + layer.bias.double()
    for args in ({"activation": "gelu"}, {"residual": residual}, {}):
        a, b = kernel(x, **args).float(), fallback(x, **args).float()
        # the same rotation and codes, bit for bit: only the epilogue's roundings differ
        assert ((a - b).abs() <= 4 * torch.finfo(dtype).eps * (1 + b.abs() + residual.float().abs())).all(), args
    y = kernel(x).double()
    assert (y - exact).abs().max() <= 0.02 * exact.abs().max()  # int8's error, not a wrong rotation's
    assert Int8Linear(_layer(150, 200), "kernel", rotate=True).rotation == 0  # K not a multiple of ROTATION


def test_a_compiled_int8_decoder_runs_its_gated_layers_as_the_eager_one():
    from parity_tests.conftest import model_dir
    from xenc_lab import Scorer

    pairs = [("what is a cache", "a cache keeps " + "results and keys " * (i + 1)) for i in range(12)]
    eager = Scorer(model_dir("qwen3-reranker"), device="cpu", dtype="bfloat16", quantization="int8")
    compiled = Scorer(model_dir("qwen3-reranker"), device="cpu", dtype="bfloat16", quantization="int8", compile=True)
    assert any(getattr(m, "gated", False) for m in compiled.engine.runner.model.modules())
    a, b = torch.tensor(eager.predict(pairs)), torch.tensor(compiled.predict(pairs))
    assert a.std() > 0 and (a - b).abs().max() <= 1e-3 * (a.max() - a.min())
