"""int8 linear layers on the CPU (``quantization="int8"``): weights int8 per output channel, symmetric, quantized
once at load; activations int8 per token, quantized on the fly (dynamic, no calibration); int32 sums; the scales,
the bias, the GELU or the residual applied in float32 and rounded once to the model's dtype. Each block of 128 input
features is rotated by a Hadamard matrix first, the weights at load and the activations on the fly
(``hadamard_rows``): the product is unchanged, and a token's outlier features no longer set its quantization step.
A layer whose GELU or silu(gate) * up feeds another int8 layer can run with it a block of rows at a time
(``Int8Linear.then``), the intermediate kept in cache.

Two routes, the first that runs here (docs/int8.md has the measurements behind them):

- ``"kernel"``: xenc_lab's GEMM (``csrc/gemm_int8.cpp``): the products on ATen's u8 x s8 brgemm ukernel (oneDNN's
  AVX512-VNNI or AMX-INT8: ATen runs it on no other CPU), else on the kernel's own 256-bit VNNI products (CPUs with
  AVX-VNNI alone), x quantized a block of rows at a time in cache, the epilogue on each
  output tile in cache. Checked once per process on a small problem against the same arithmetic in torch.
- ``"torch"``: the same arithmetic with torch's ops (the int32 sums by exact float GEMMs): CPUs or builds where
  the kernel does not run (CPUs with AVX2 alone among them), slower there than float32; loading warns of it.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from .int8_math import (
    INT8_COLS,
    ROTATION,
    gated_order,
    hadamard_rows,
    int8_blocks,
    quantize_rows,
    quantize_weight,
    torch_linear_int8,
)
from .native import available, once, reason
from .prepacked import PrepackedLinear, rows_of

logger = logging.getLogger("xenc_lab")

ROUTES = ("kernel", "torch")


@torch.compiler.assume_constant_result  # checked eagerly, a constant to torch.compile
def int8_kernel_available() -> bool:
    """Whether ``linear_int8`` runs here: a build with ATen's u8 x s8 brgemm, checked once per process on a small
    problem (a partial block of rows and of columns, K not a multiple of 4, GELU and residual, float32 and bfloat16)
    against the same quantized arithmetic done with torch's ops."""
    if not available() or not torch.ops.xenc_lab.int8_gemm_built():
        return False
    return once("int8 gemm", _choose_products)


def _choose_products() -> bool:
    """ATen's brgemm for the products where it passes the check; else, where this build has them, the kernel's own
    on 256-bit registers (CPUs with AVX-VNNI but not AVX512-VNNI, on which ATen's brgemm refuses u8 x s8), checked
    the same way."""
    if _int8_check():
        return True
    global _own_products
    if torch.ops.xenc_lab.int8_own_products(True):
        if _int8_check():
            logger.info("xenc_lab's int8 GEMM runs its own 256-bit VNNI products here (ATen's int8 brgemm does not)")
            _own_products = True
            return True
        torch.ops.xenc_lab.int8_own_products(False)
    return False


_own_products = False  # what _choose_products chose


def int8_products() -> str | None:
    """What multiplies the kernel route's int8 codes here: "brgemm" (ATen's, oneDNN: AVX512-VNNI or AMX-INT8), "own"
    (the kernel's 256-bit VNNI products), or None where the kernel does not run."""
    if not int8_kernel_available():
        return None
    return "own" if _own_products else "brgemm"


def _int8_check() -> bool:
    g = torch.Generator().manual_seed(0)
    x, weight, bias, residual = (torch.randn(*shape, generator=g) for shape in ((100, 74), (80, 74), (80,), (100, 80)))
    wide_x, wide_weight = torch.randn(100, 2 * ROTATION, generator=g), torch.randn(80, 2 * ROTATION, generator=g)
    q, scale = quantize_weight(weight)
    packed = int8_blocks(q, scale, bias)
    weight_t = q.t().contiguous()
    # A gated layer (two blocks of columns: gate, then up) and a rotated one (two Hadamard blocks).
    gate_up = weight[:64].repeat(2, 1)
    gate_up[64:] = -gate_up[64:].flip(1)
    gated_q, gated_scale = quantize_weight(gate_up[gated_order(64)])
    gated_t = gated_q.t().contiguous()
    rotated_q, rotated_scale = quantize_weight(hadamard_rows(wide_weight))
    rotated_scale = rotated_scale / ROTATION
    for dtype in (torch.float32, torch.bfloat16):
        xd, rd, wide, eps = x.to(dtype), residual.to(dtype), wide_x.to(dtype), torch.finfo(dtype).eps
        # A product within a rounding of the rounded one may round to the other side of a tie: one step of x's
        # quantization in one term, at most. A wrong layout or scale is off by units.
        step = quantize_rows(xd)[1] * weight.abs().amax(dim=1)[None]
        for activation in ("gelu", "none"):
            add = rd if activation == "none" else None
            want = torch_linear_int8(xd.float(), weight_t, scale, bias, activation,
                                     None if add is None else add.float())
            room = 2 * eps * (1 + want.abs()) + 1.1 * step
            if not _kernel_agrees(f"{dtype}, {activation}", want, room, xd, *packed, 80, activation, add):
                return False
        # silu(gate) * up: within a step of the gate's and the up's products
        want = torch_linear_int8(xd.float(), gated_t, gated_scale, None, "silu_mul", None)
        products = torch_linear_int8(xd.float(), gated_t, gated_scale, None, "none", None).abs()
        room = 2 * eps * (1 + want.abs()) + 2.2 * step[:, :64] * (1 + products.amax(dim=1, keepdim=True))
        if not _kernel_agrees(f"{dtype}, silu_mul", want, room, xd, *int8_blocks(gated_q, gated_scale, None), 128,
                              "silu_mul", None):
            return False
        # Rotated, with a residual: the same rotation, codes and int32 sums as torch's, bit for bit; the epilogues
        # round in another order, a few roundings of the sum before the residual.
        want = torch_linear_int8(wide.float(), rotated_q.t().contiguous(), rotated_scale, bias, "none", rd.float(),
                                 ROTATION)
        room = 4 * eps * (1 + want.abs() + rd.float().abs())
        if not _kernel_agrees(f"{dtype}, rotated", want, room, wide, *int8_blocks(rotated_q, rotated_scale, bias), 80,
                              "none", rd, ROTATION):
            return False
    return True


@torch.compiler.assume_constant_result
def int8_mlp_available() -> bool:
    """Whether ``mlp_int8`` (two int8 layers a block of rows at a time, ``Int8Linear.then``) runs here and computes
    what two ``linear_int8`` calls compute, to the bit: checked once per process on a small problem (partial blocks,
    a rotated first layer, GELU then a residual, float32 and bfloat16). Where it does not, the layers run one at a
    time."""
    return once("int8 mlp", lambda: int8_kernel_available() and _int8_mlp_check())  # a lookup after the first call


def int8_norm_available() -> bool:
    """Whether the int8 kernel's calls can end in a LayerNorm (``Int8Linear._gemm`` and ``then`` with ``norm``) and
    compute what the layer_norm op computes on their output, to the bit: checked once per process in bfloat16 and
    float16, the dtypes whose LayerNorm is that op (``cpu.norm.RowLayerNorm``). Where not, the norm runs after."""
    return once("int8 norm", lambda: int8_mlp_available() and _int8_norm_check())


def _norm_args(norm: nn.LayerNorm | None) -> tuple:
    return () if norm is None else (norm.weight, norm.bias, float(norm.eps))


def _two_layers(seed: int, width: int) -> tuple:
    """The checks' problem: a generator, x (100, width), a rotated GELU layer of 200 and a plain one of 90, each as
    the ops take it (the first's arguments end with its activation and rotation)."""
    g = torch.Generator().manual_seed(seed)
    x, up, down = (torch.randn(*shape, generator=g) for shape in ((100, width), (200, width), (90, 200)))
    up_q, up_scale = quantize_weight(hadamard_rows(up))
    first = (*int8_blocks(up_q, up_scale / ROTATION, torch.randn(200, generator=g)), 200, "gelu", ROTATION)
    down_q, down_scale = quantize_weight(down)
    return g, x, first, (*int8_blocks(down_q, down_scale, torch.randn(90, generator=g)), 90)


def _int8_norm_check() -> bool:
    g, x, first, second = _two_layers(2, ROTATION)
    for dtype in (torch.bfloat16, torch.float16):
        xd, residual = x.to(dtype), torch.randn(100, 90, generator=g).to(dtype)
        norm = tuple(torch.randn(90, generator=g).to(dtype) for _ in range(2)) + (1e-5,)
        try:
            plain = torch.ops.xenc_lab.mlp_int8(xd, *first, *second, residual, 0)
            pairs = [(torch.ops.xenc_lab.mlp_int8(xd, *first, *second, residual, 0, *norm), plain)]
            hidden = torch.ops.xenc_lab.linear_int8(xd, *first[:-1], None, ROTATION)
            plain = torch.ops.xenc_lab.linear_int8(hidden, *second, "none", residual, 0)
            pairs.append((torch.ops.xenc_lab.linear_int8(hidden, *second, "none", residual, 0, *norm), plain))
            for got, before in pairs:
                if not torch.equal(got, torch.ops.xenc_lab.layer_norm(before, *norm)):
                    logger.info("xenc_lab's int8 calls ending in a LayerNorm are off here (%s); the norm runs after",
                                dtype)
                    return False
        except RuntimeError as e:
            logger.info("xenc_lab's int8 calls ending in a LayerNorm do not run here (%s); the norm runs after",
                        reason(e))
            return False
    return True


def _int8_mlp_check() -> bool:
    g, x, first, second = _two_layers(1, 2 * ROTATION)
    for dtype in (torch.float32, torch.bfloat16):
        xd, residual = x.to(dtype), torch.randn(100, 90, generator=g).to(dtype)
        try:
            want = torch.ops.xenc_lab.linear_int8(torch.ops.xenc_lab.linear_int8(xd, *first[:-1], None, ROTATION),
                                                  *second, "none", residual, 0)
            got = torch.ops.xenc_lab.mlp_int8(xd, *first, *second, residual, 0)
        except RuntimeError as e:
            logger.info("xenc_lab's two-layer int8 call does not run here (%s); one layer at a time", reason(e))
            return False
        if not torch.equal(got, want):
            logger.info("xenc_lab's two-layer int8 call is off by %.3g here (%s); one layer at a time",
                        (got.float() - want.float()).abs().max().item(), dtype)
            return False
    return True


def _kernel_agrees(case: str, want: torch.Tensor, room: torch.Tensor, *args) -> bool:
    """Whether ``linear_int8(*args)`` runs here and lands within ``room`` of ``want`` (the torch route's result)."""
    try:
        got = torch.ops.xenc_lab.linear_int8(*args).float()
    except RuntimeError as e:
        logger.info("xenc_lab's int8 GEMM does not run here (%s); using torch's int8 ops", reason(e))
        return False
    if not ((got - want).abs() - room).max().item() <= 0:  # a NaN fails
        logger.info("xenc_lab's int8 GEMM (%s) is off by %.3g here; using torch's int8 ops", case,
                    (got - want).abs().max().item())
        return False
    return True


def int8_route() -> str:
    return "kernel" if int8_kernel_available() else "torch"


class Int8Linear(PrepackedLinear):
    """A Linear quantized once at load: int8 weights per output channel, activations per token on the fly; see the
    module's docstring for the routes. The float weight is not kept (``weight`` is None): resident are the int8
    weight, its per-column scales and corrections, and the bias."""

    def __init__(self, linear: nn.Linear, route: str | None = None, gated: bool = False, rotate: bool = False):
        nn.Module.__init__(self)
        if route is not None and route not in ROUTES:
            raise ValueError(f"route must be None or one of {', '.join(ROUTES)}, got {route!r}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.route = route or int8_route()
        if self.route == "kernel" and not int8_kernel_available():
            self.route = "torch"
        self.gemm, self.fused, self.gelu_gemm = "int8", True, None
        # Gated: a fused gate/up layer (gate rows, then up rows) run only as silu(gate) * up, its rows in gated_order.
        self.gated = gated
        # Rotated: each ROTATION input features by a Hadamard block, the weight here and x in the GEMM (its sums are
        # ROTATION times the product: the scales take the 1 / ROTATION, a power of two).
        self.rotation = ROTATION if rotate and self.in_features % ROTATION == 0 else 0
        order = gated_order(self.out_features // 2) if gated else slice(None)
        weight = linear.weight.detach().float()[order]
        q, scale = quantize_weight(hadamard_rows(weight) if self.rotation else weight)
        scale = scale / ROTATION if self.rotation else scale
        bias = None if linear.bias is None else linear.bias.detach().float()[order]
        self.weight, self.bias = None, linear.bias
        if self.route == "kernel":
            self.packed, self._correction, self._scale, self._bias = int8_blocks(q, scale, bias)
        else:
            self.packed, self._scale, self._bias = q.t().contiguous(), scale, bias
        self._rows: dict[tuple[int, int], Int8Linear] = {}
        self.key = next(PrepackedLinear._keys)
        from .prepacked import _PREPACKED
        _PREPACKED[self.key] = self

    @property
    def nbytes(self) -> int:
        """Bytes resident for this layer's weight: the int8 weight (padded), the scales, corrections and bias."""
        parts = [self.packed, self._scale, getattr(self, "_correction", None), self._bias]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def rows(self, start: int, stop: int) -> Int8Linear:
        """Output features start:stop; the kernel's blocks are sliced in place where start and stop fall on them."""
        if (start, stop) == (0, self.out_features):
            return self
        if self.gated:
            raise ValueError(f"a gated int8 layer runs whole, not as rows {start}:{stop}")
        if (start, stop) not in self._rows:
            part = Int8Linear.__new__(Int8Linear)
            nn.Module.__init__(part)
            part.in_features, part.out_features, part.route = self.in_features, stop - start, self.route
            part.gemm, part.fused, part.gelu_gemm, part.weight, part.gated = "int8", True, None, None, False
            part.rotation = self.rotation
            part.bias = None if self.bias is None else self.bias[start:stop]
            part._rows, part.key = {}, self.key
            if self.route == "kernel" and start % INT8_COLS == 0:
                blocks = slice(start // INT8_COLS, -(-stop // INT8_COLS))
                columns = slice(start, blocks.stop * INT8_COLS)
                part.packed, part._correction = self.packed[blocks], self._correction[columns]
                part._scale, part._bias = self._scale[columns], self._bias[columns]
            elif self.route == "torch":
                part.packed, part._scale = self.packed[:, start:stop].contiguous(), self._scale[start:stop]
                part._bias = None if self._bias is None else self._bias[start:stop]
            else:  # unaligned columns of the kernel's blocks: the whole product, then the columns
                return _Columns(self, start, stop)
            self._rows[start, stop] = part
        return self._rows[start, stop]

    def _gemm(self, x: torch.Tensor, activation: str, residual: torch.Tensor | None = None,
              norm: nn.LayerNorm | None = None) -> torch.Tensor:
        """The layer's product with its activation or residual; with ``norm``, that LayerNorm of it (on the kernel
        route inside the call, each block of rows normed while in cache: ``int8_norm_available``)."""
        if residual is not None and activation != "none":
            raise ValueError(f"a residual is added to the plain product only, not after {activation!r}")
        if self.gated != (activation == "silu_mul"):
            raise ValueError("a gated int8 layer runs as silu_mul only, and silu_mul runs on gated layers only; "
                             f"got activation {activation!r} on a {'gated' if self.gated else 'plain'} layer")
        rows, residual = self._rows_of(x), rows_of(residual, self.out_features)
        if self.route == "kernel":
            y = torch.ops.xenc_lab.linear_int8(rows, self.packed, self._correction, self._scale, self._bias,
                                               self.out_features, activation, residual, self.rotation,
                                               *_norm_args(norm))
        else:
            y = torch_linear_int8(rows, self.packed, self._scale, self._bias, activation, residual, self.rotation)
            y = y if norm is None else norm(y)
        return y.view(*x.shape[:-1], y.shape[-1])

    def then(self, second: Int8Linear, x: torch.Tensor, activation: str, residual: torch.Tensor | None,
             norm: nn.LayerNorm | None = None) -> torch.Tensor:
        """second(this layer's ``activation`` of x) + residual, a block of rows at a time (``mlp_int8``): the
        intermediate stays in cache, where two calls would write it out and read it back. Each row is what the two
        calls compute, to the bit. Both layers must run on the kernel route. With ``norm``, its LayerNorm of that,
        each block of rows normed while in cache (``int8_norm_available``)."""
        if not (self.route == second.route == "kernel" and second.in_features == self.out_features // (
                2 if self.gated else 1) and self.gated == (activation == "silu_mul") and not second.gated):
            raise ValueError(f"then() takes two kernel-route int8 layers whose widths chain, a plain second, and the "
                             f"first's own activation; got {self!r}, {second!r}, activation {activation!r}")
        rows, residual = self._rows_of(x), rows_of(residual, second.out_features)
        y = torch.ops.xenc_lab.mlp_int8(rows, self.packed, self._correction, self._scale, self._bias, self.out_features,
                                        activation, self.rotation, second.packed, second._correction, second._scale,
                                        second._bias, second.out_features, residual, second.rotation,
                                        *_norm_args(norm))
        return y.view(*x.shape[:-1], second.out_features)

    def extra_repr(self) -> str:
        gated = ", gated: silu(gate) * up" if self.gated else ""
        rotated = f", inputs rotated by {self.rotation}" if self.rotation else ""
        route = f"kernel, {int8_products()} products" if self.route == "kernel" else self.route
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 ({route}){gated}{rotated}"


class _Columns:
    """Columns start:stop of an Int8Linear's product (computed whole): rows that do not fall on the kernel's blocks."""

    def __init__(self, layer: Int8Linear, start: int, stop: int):
        self.layer, self.start, self.stop = layer, start, stop

    def _gemm(self, x, activation, residual=None):
        if residual is not None:
            raise ValueError("a residual is added to whole layers only")
        return self.layer._gemm(x, activation)[..., self.start:self.stop]


def quantize_linears(model: nn.Module, keep: Iterable[nn.Module] = (), rotate: bool = False) -> int:
    """Replace every float nn.Linear of a CPU model by an Int8Linear, but those in ``keep`` (which stay in the model's
    dtype), rotating their inputs where ``rotate``; returns how many. A module's ``silu_gated()`` (a decoder MLP's)
    names its fused gate/up layer where SiLU follows it: that layer is quantized gated, its epilogue computing
    silu(gate) * up (one pass over the intermediate rather than three)."""
    kept = {id(module) for module in keep}
    gated = {id(layer) for module in model.modules() if hasattr(module, "silu_gated")
             for layer in [module.silu_gated()] if layer is not None and layer.out_features % INT8_COLS == 0}
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in kept or type(child) is not nn.Linear or child.weight.device.type != "cpu":
                continue
            setattr(parent, name, Int8Linear(child, gated=id(child) in gated, rotate=rotate))
            count += 1
    return count


def int8_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes resident for the int8 layers' weights, bytes their weights took in float32)."""
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    return sum(m.nbytes for m in layers), sum(4 * m.in_features * m.out_features for m in layers)
