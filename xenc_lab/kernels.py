"""Native CPU kernels, compiled on first use (torch.utils.cpp_extension, JIT) and cached on disk.

The extension in ``csrc/`` is built with ``-O3 -march=native`` into ``$XENC_LAB_CACHE/kernels/<torch version>/<cpu>``
(default ``~/.cache/xenc_lab/kernels/...``), once per kind of CPU and version of the sources, and loaded once per
process. Each build runs in a directory of its own and publishes the finished library with an atomic rename, so
concurrent first uses do not wait on each other and a build killed halfway leaves nothing that blocks the next.
When it cannot be built (no compiler, no ninja, ...) or ``XENC_LAB_NO_KERNELS=1`` is set, one warning is logged and
the functions here return None: callers fall back to torch's own ops.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from .cpuinfo import cpu_info

logger = logging.getLogger("xenc_lab")

_SOURCES = [Path(__file__).parent / "csrc" / "packed_attention.cpp"]
_NAME = "xenc_lab_kernels"

_lock = threading.Lock()
# Answers found once per process: "loaded" (the extension's ops are in torch.ops.xenc_lab), ("tiles", dtype) (the
# tile path runs at dtype), "widened gemm" (linear_widened runs), "f32 gemm" (linear_f32 runs), "half gemm" (linear_half runs).
_answers: dict[object, bool] = {}


def _once(key: object, find) -> bool:
    """``find()``'s answer for ``key``, found by the first caller (others wait for it) and kept."""
    if key not in _answers:
        with _lock:
            if key not in _answers:
                _answers[key] = find()
    return _answers[key]


def _build_directory() -> Path:
    root = Path(os.environ.get("XENC_LAB_CACHE", Path.home() / ".cache" / "xenc_lab"))
    return root / "kernels" / torch.__version__ / _cpu_tag()


def _cpu_tag() -> str:
    """The machine and a hash of its CPU model and features: a -march=native build is only reused on the same kind
    of CPU, even when the cache directory is shared between machines."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = [platform.processor()]
    keys = ("model name", "flags", "features", "cpu part")  # x86 model and flags; Arm features and core part
    cpu = sorted({line for line in lines if line.lower().startswith(keys)} or set(lines))
    digest = hashlib.sha256("\n".join(cpu).encode()).hexdigest()
    return f"{platform.machine()}-{digest[:12]}"


def _compiler_flags() -> tuple[list[str], list[str]]:
    """(cflags, ldflags). -ffp-contract=fast lets the generic-vector kernel (no AVX-512) use FMA instructions.
    at::parallel_for is inline: with torch's OpenMP backend the extension must be compiled with OpenMP too, or
    every parallel_for would run on one thread. Linking -fopenmp adds a libgomp.so.1 NEEDED entry, which resolves
    to the libgomp torch already loaded (same soname), so both share one thread pool.

    XENC_PAIRED_BF16 chooses how bf16 attention computes its two products where the CPU has AVX512-BF16: by the
    bf16 pair dot product on AMD cores, where one does the work of two fp32 FMAs (scores from bf16 query and key
    pairs; weighted sums from the softmax numerators rounded to bf16, ``paired_bf16``), and by fp32 FMAs on keys and
    values widened to fp32 elsewhere: Intel cores issue one pair dot product per cycle against two FMAs, and the
    widened path measured 20-27% faster there (it is also the more exact one). On an AMD EPYC (Zen 5) the paired
    weighted sums made attention alone 1.14-1.25x faster at 91-508 tokens per pair than fp32 FMAs on widened
    values (same process, alternating)."""
    paired = cpu_info().vendor == "AuthenticAMD"
    cflags, ldflags = ["-O3", "-march=native", "-ffp-contract=fast", f"-DXENC_PAIRED_BF16={int(paired)}"], []
    # Flags of one's own, appended (later ones win): the tests build the code paths of other CPUs this way.
    cflags += os.environ.get("XENC_LAB_KERNEL_CFLAGS", "").split()
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    return cflags, ldflags


def _packed_attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, num_heads, scale, window):
    return q.new_empty(q.shape)


def _linear_fake(x, blocks, bias, out_features, activation, residual):
    return x.new_empty((x.shape[0], out_features))


def _linear_half_fake(x, blocks, weight_exponent, bias, out_features, activation, residual):
    return x.new_empty((x.shape[0], out_features))


_TILE_DTYPES = (torch.bfloat16, torch.float16)


def _ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; a virtual environment's own ninja (the PyPI package) is not on it unless
    the environment is activated, so put it there."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _library_path(cflags: list[str], ldflags: list[str]) -> Path:
    """Where the built library lives: named by a hash of the sources and flags, so an edit means a new build."""
    digest = hashlib.sha256()
    for source in _SOURCES:
        digest.update(source.read_bytes())
    digest.update(" ".join(cflags + ldflags).encode())
    return _build_directory() / f"{_NAME}-{digest.hexdigest()[:16]}.so"


def _compile_into(library: Path, cflags: list[str], ldflags: list[str]) -> None:
    """Build in a private directory next to ``library``, then rename the result into place (atomic on one
    filesystem): other processes see either no library or a whole one."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    logger.info("compiling xenc_lab's CPU attention kernel into %s (once per kind of CPU and torch version)", library.parent)
    library.parent.mkdir(parents=True, exist_ok=True)
    for stale in library.parent.glob("build-*"):  # left by builds that were killed: none takes an hour
        if time.time() - stale.stat().st_mtime > 3600:
            shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="build-", dir=library.parent) as scratch:
        cpp_extension.load(
            name=_NAME,
            sources=[str(s) for s in _SOURCES],
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            build_directory=scratch,
            is_python_module=False,
            verbose=False,
        )
        os.replace(Path(scratch) / f"{_NAME}.so", library)


def _build() -> bool:
    """Builds (or finds built) and loads the extension; False, with one warning, if that fails or is disabled."""
    if os.environ.get("XENC_LAB_NO_KERNELS") == "1":
        logger.warning("xenc_lab native kernels disabled by XENC_LAB_NO_KERNELS=1; using torch ops instead")
        return False
    try:
        cflags, ldflags = _compiler_flags()
        library = _library_path(cflags, ldflags)
        if library.exists():
            torch.ops.load_library(str(library))
        else:  # the build loads what it built
            _compile_into(library, cflags, ldflags)
        # Shapes for tracing (torch.compile, meta tensors): the output is q-shaped, whatever the data.
        torch.library.register_fake("xenc_lab::packed_attention", _packed_attention_fake)
        torch.library.register_fake("xenc_lab::packed_attention_tiles", _packed_attention_fake)
        torch.library.register_fake("xenc_lab::layer_norm", lambda x, weight, bias, eps: x.new_empty(x.shape))
        torch.library.register_fake("xenc_lab::linear_widened", _linear_fake)
        torch.library.register_fake("xenc_lab::linear_f32", _linear_fake)
        torch.library.register_fake("xenc_lab::linear_half", _linear_half_fake)
        return True
    except Exception as e:  # any failure to build or load means: no kernels, use the fallback
        logger.warning("xenc_lab native kernels unavailable (%s); using torch ops instead", _reason(e))
        logger.debug("xenc_lab native kernel build failure", exc_info=True)
        return False


def _reason(e: Exception) -> str:
    """One line on why the build failed. A failed build's message is ninja's log: skip its progress lines and the
    echoed commands, and prefer a compiler error line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    progress = ("Error building extension", "[", "FAILED:", "ninja:")
    commands = (" -MMD ", " -shared ")
    informative = [line for line in lines if not line.startswith(progress) and not any(c in line for c in commands)]
    errors = [line for line in informative if "error" in line.lower()]
    line = (errors or informative or lines or [""])[0]
    return f"{type(e).__name__}: {line[:300]}"


@torch.compiler.assume_constant_result
def _available() -> bool:
    """Whether the extension is loaded, building and loading it on the first call of the process. A constant to
    torch.compile, which calls it once while tracing (a build cannot be traced) and keeps the answer."""
    return _once("loaded", _build)


def load() -> bool:
    """Builds (first time on this kind of CPU) and loads the native kernels now rather than inside the first
    forward pass; True if they are available. ``Scorer`` calls it when loading a model onto the CPU."""
    return _available()


@torch.compiler.assume_constant_result  # checked eagerly, a constant to torch.compile
def tiles_available(dtype: torch.dtype) -> bool:
    """Whether the kernel's tile path runs here at ``dtype`` (bfloat16 or float16).

    The tile path computes Q K^T and P V as oneDNN batch-reduce GEMMs through ATen (``at::native::cpublas::brgemm``),
    on AMX tiles where the CPU has them for the dtype. It needs an AVX-512 build, a torch whose oneDNN takes the
    dtype on this CPU, and the B layout oneDNN expects for it here to be the VNNI pairs the path packs: that is
    checked, not assumed, by a small problem computed both ways and compared with the kernel, once per process and
    dtype (oneDNN's float16 GEMMs, for one, expect another layout on CPUs without AMX-FP16)."""
    if dtype not in _TILE_DTYPES or not _available() or not torch.ops.xenc_lab.tiles_built():
        return False
    return _once(("tiles", dtype), lambda: _tiles_check(dtype))


def _tiles_check(dtype: torch.dtype) -> bool:
    """The tile path against the kernel on three sequences (a lone query, a partial key tile, two query blocks)."""
    cu = torch.tensor([0, 1, 46, 116], dtype=torch.int32)
    qkv = torch.randn(116, 3 * 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    q, k, v = qkv.split(64, dim=1)
    expected = torch.ops.xenc_lab.packed_attention(q, k, v, cu, cu, 2, 0.3, -1).float()
    return _agrees(  # within the rounding of P and of the output, with room
        f"tile attention in {dtype}", lambda: torch.ops.xenc_lab.packed_attention_tiles(q, k, v, cu, cu, 2, 0.3, -1),
        expected, 8 * torch.finfo(dtype).eps, "oneDNN expects another layout; using the kernel")


def _agrees(what: str, run, expected: torch.Tensor, tolerance: float, otherwise: str) -> bool:
    """Whether ``run()`` runs here and comes within ``tolerance`` of ``expected`` (relative to 1 + |expected|; a
    NaN fails); a self-check's answer, logged where it is no."""
    try:
        out = run().float()
    except RuntimeError as e:
        logger.info("xenc_lab's %s does not run here (%s)", what, _reason(e))
        return False
    error = ((out - expected).abs() / (1 + expected.abs())).max().item()
    if not error <= tolerance:
        logger.info("xenc_lab's %s is off by %.3g here (%s)", what, error, otherwise)
        return False
    return True


def packed_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    num_heads: int,
    scale: float | None,
    window: int | None = None,
    tiles: bool = False,
) -> torch.Tensor | None:
    """softmax(q k^T * scale) v per sequence and head, on a packed token stream; None without the kernel.

    q is (Tq, H * dh), k and v (Tk, H * dh), float32, bfloat16 or float16 (head_dim <= 256), rows possibly strided
    (column slices of one fused qkv tensor are read in place). Sequence b's keys and values are rows
    cu_seqlens_k[b]:[b + 1]; its queries are rows cu_seqlens_q[b]:[b + 1] of q and are the FIRST tokens of the
    sequence: cu_seqlens_q == cu_seqlens_k for self-attention, arange(B + 1) for the first token only. With
    ``window``, key j is visible from query i iff |i - j| <= window // 2. ``scale`` None means head_dim ** -0.5.
    Returns (Tq, H * dh) contiguous, q's dtype; rows of q outside every sequence come back as zeros.
    Everything but the inputs and the output is computed in float32.

    ``tiles``: in bfloat16 and float16, compute the two products with the tile path (``tiles_available``), where
    it runs here (else the kernel computes as usual). There the softmax numerators are rounded to the input type
    before they weight the values, as in torch's flash attention; the sums that divide them stay float32.
    """
    if not _available():
        return None
    if window is not None and window < 0:
        raise ValueError(f"window must be >= 0 or None, got {window}")
    if scale is None:
        scale = (q.shape[-1] // num_heads) ** -0.5
    op = torch.ops.xenc_lab.packed_attention
    if tiles and tiles_available(q.dtype):
        op = torch.ops.xenc_lab.packed_attention_tiles
    return op(q, k, v, cu_seqlens_q, cu_seqlens_k, num_heads, float(scale), -1 if window is None else int(window))


def folded_pool_cpu(x: torch.Tensor, folded: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor | None:
    """Per pair b (rows cu_seqlens[b]:[b + 1] of x, (T, d)) and head h, sum_j softmax_j(x_j . folded[h, b]) x_j as
    (B, H, d), zeros for empty pairs and pairs past cu_seqlens (``layers.folded_first_token_attention``); None
    without the kernel. The pairs are shared among the threads, each pair's ops single-threaded."""
    if not _available():
        return None
    return torch.ops.xenc_lab.folded_pool(x, folded, cu_seqlens)


def layer_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor | None:
    """LayerNorm over the last dimension of a 2-D CPU tensor (float32, bfloat16, float16; columns contiguous),
    computed in float32 and rounded once to x's dtype, as torch's; None without the kernel. ``weight`` and
    ``bias`` are contiguous, of x's dtype, or None."""
    if not _available():
        return None
    return torch.ops.xenc_lab.layer_norm(x, weight, bias, float(eps))


GEMM_COLS = 64  # columns of W^T per packed block of ``linear_widened`` and ``linear_f32`` (kGemmCols in the C++ source)


def gemm_blocks(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear layer's (N, K) weight and (N,) bias (or None) in ``linear_widened``'s and ``linear_f32``'s layout: float32 blocks
    (ceil(N / 64), K, 64) of W^T and a (ceil(N / 64) * 64,) bias, zero-padded past N."""
    n, k = weight.shape
    width = -(-n // GEMM_COLS) * GEMM_COLS
    wt = torch.zeros(k, width, dtype=torch.float32)
    wt[:, :n] = weight.detach().t().float()
    padded = torch.zeros(width, dtype=torch.float32)
    if bias is not None:
        padded[:n] = bias.detach().float()
    return wt.view(k, width // GEMM_COLS, GEMM_COLS).permute(1, 0, 2).contiguous(), padded


def _gemm_f32_built() -> bool:
    """Whether the fp32 GEMMs (``linear_f32``, ``linear_widened``) are in this build: AVX2 and FMA or AVX-512, and a
    torch with ATen's fp32 brgemm."""
    return _available() and torch.ops.xenc_lab.gemm_f32_built()


def _gemm_check_problem() -> tuple[torch.Tensor, ...]:
    """x (100, 72), W (80, 72), bias and residual: a partial block of rows (96) and of columns (64) for the
    self-checks."""
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*shape, generator=g) for shape in ((100, 72), (80, 72), (80,), (100, 80)))


@torch.compiler.assume_constant_result  # checked eagerly, a constant to torch.compile
def widened_gemm_available() -> bool:
    """Whether ``linear_widened`` runs here: a build for a CPU with AVX2 and FMA (or AVX-512) and a torch with ATen's
    fp32 brgemm, checked once per process in bfloat16 and float16 on a small problem (a partial block of rows and of
    columns, GELU and residual) against torch's own ops."""
    if not _gemm_f32_built():
        return False
    return _once("widened gemm", _widened_gemm_check)


def _widened_gemm_check() -> bool:
    x, weight, bias, residual = _gemm_check_problem()
    for dtype in (torch.bfloat16, torch.float16):
        x16, w16, r16 = x.to(dtype), weight.to(dtype), residual.to(dtype)
        blocks, padded = gemm_blocks(w16, bias)
        product = x16.float() @ w16.float().t() + bias
        for activation, want in {"gelu": torch.nn.functional.gelu(product), "none": product + r16.float()}.items():
            add = r16 if activation == "none" else None
            if not _agrees(  # one rounding to dtype, with room
                f"{dtype} GEMM ({activation})",
                lambda: torch.ops.xenc_lab.linear_widened(x16, blocks, padded, 80, activation, add),  # noqa: B023
                want, 2 * torch.finfo(dtype).eps, "using oneDNN's",
            ):
                return False
    return True


@torch.compiler.assume_constant_result  # checked eagerly, a constant to torch.compile
def f32_gemm_available() -> bool:
    """Whether ``linear_f32`` runs here: a build for a CPU with AVX2 and FMA (or AVX-512) and a torch with ATen's fp32
    brgemm, checked once per process on a small problem (a partial block of rows and of columns, GELU and residual)
    against the exact result."""
    if not _gemm_f32_built():
        return False
    return _once("f32 gemm", _f32_gemm_check)


def _f32_gemm_check() -> bool:
    x, weight, bias, residual = _gemm_check_problem()
    blocks, padded = gemm_blocks(weight, bias)
    product = x.double() @ weight.double().t() + bias.double()
    expected = {"gelu": torch.nn.functional.gelu(product), "none": product + residual.double()}
    return all(  # fp32 rounding of 72-term sums, about 1e-6 here; a wrong layout is off by units
        _agrees(f"fp32 GEMM ({activation})", lambda a=activation: torch.ops.xenc_lab.linear_f32(
            x, blocks, padded, 80, a, residual if a == "none" else None).double(), want, 1e-5, "using oneDNN's")
        for activation, want in expected.items()
    )


def linear_f32_cpu(
    x: torch.Tensor,
    blocks: torch.Tensor,
    bias: torch.Tensor,
    out_features: int,
    activation: str = "none",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T + bias, then exact GELU (``activation="gelu"``, torch's erf approximation) or ``+ residual``, in
    float32: x is (M, K) float32 with contiguous columns, ``blocks``/``bias`` from ``gemm_blocks``. ATen's fp32
    brgemm (oneDNN) on blocks of 96 rows by 64 columns, the bias and GELU or residual applied to each output tile in
    cache. Callers check ``f32_gemm_available()`` first."""
    return torch.ops.xenc_lab.linear_f32(x, blocks, bias, out_features, activation, residual)


def linear_widened_cpu(
    x: torch.Tensor,
    blocks: torch.Tensor,
    bias: torch.Tensor,
    out_features: int,
    activation: str = "none",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T + bias, then exact GELU (``activation="gelu"``) or ``+ residual``, rounded once to x's dtype: x is
    (M, K) bfloat16 or float16 with contiguous columns, ``blocks``/``bias`` from ``gemm_blocks``. Products and sums
    in float32 (a bf16 or fp16 GEMM's arithmetic: products of either are exact in float32); x widened a block at a
    time in cache, bias, GELU, residual and rounding applied to each output tile in cache. Callers check
    ``widened_gemm_available()`` first."""
    return torch.ops.xenc_lab.linear_widened(x, blocks, bias, out_features, activation, residual)


HALF_GEMM_COLS = 128  # columns of W^T per packed block of ``linear_half`` (kHalfCols in the C++ source)
HALF_GEMM_CHUNK = 64  # consecutive k summed in float16 before the float32 sum (kHalfChunk)
HALF_GEMM_ROW_MAX = 7  # each row of x is scaled so that its largest element is below 2^7 (kHalfRowMax)


def half_blocks(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, int, torch.Tensor]:
    """A linear layer's (N, K) weight and (N,) bias (or None) in ``linear_half``'s layout: float16 blocks
    (ceil(N / 128), K, 128) of W^T scaled by 2^t so that its largest element lies in [1, 2), t, and a float32
    (ceil(N / 128) * 128,) bias; zero-padded past N. A bfloat16 weight is exact in these blocks but for elements
    below 2^-14 of the largest, which fall to float16's subnormals (at most 2^-25 of the largest off)."""
    n, k = weight.shape
    largest = weight.detach().abs().max().item() if weight.numel() else 0.0
    if not math.isfinite(largest):
        raise ValueError(f"the float16 GEMM needs a finite weight, got one whose largest magnitude is {largest}")
    exponent = 1 - math.frexp(largest)[1] if largest > 0 else 0  # largest * 2^exponent in [1, 2)
    width = -(-n // HALF_GEMM_COLS) * HALF_GEMM_COLS
    wt = torch.zeros(k, width, dtype=torch.float32)
    wt[:, :n] = torch.ldexp(weight.detach().t().float(), torch.tensor(float(exponent)))
    padded = torch.zeros(width, dtype=torch.float32)
    if bias is not None:
        padded[:n] = bias.detach().float()
    blocks = wt.half().view(k, width // HALF_GEMM_COLS, HALF_GEMM_COLS).permute(1, 0, 2).contiguous()
    return blocks, exponent, padded


def paired_bf16() -> bool:
    """Whether the kernel's bf16 attention runs on the bf16 pair dot product here (the AMD build, see
    ``_compiler_flags``): scores from bf16 pairs of query and key columns, and weighted sums of the values with the
    softmax numerators rounded to bf16 (their sum is the fp32 one), as torch's flash attention computes bf16 on the
    CPU. Elsewhere both products are fp32 FMAs on widened values and only the output is rounded."""
    return _available() and bool(torch.ops.xenc_lab.paired_bf16_built())


@torch.compiler.assume_constant_result  # checked eagerly, a constant to torch.compile
def half_gemm_available() -> bool:
    """Whether ``linear_half`` runs here: a build for a CPU with AVX512-FP16, checked once per process on a small
    problem (a partial block of rows and of columns, more than one chunk of k, GELU and residual) against the
    exact result."""
    if not _available() or not torch.ops.xenc_lab.half_gemm_built():
        return False
    return _once("half gemm", _half_gemm_check)


def _half_gemm_check() -> bool:
    g = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*shape, generator=g) for shape in ((100, 136), (150, 136), (150,)))
    residual = torch.randn(100, 150, generator=g).bfloat16()
    x, weight = x.bfloat16(), weight.bfloat16()
    blocks, exponent, padded = half_blocks(weight, bias)
    product = x.double() @ weight.double().t() + bias.double()
    # float16 sums err in proportion to the terms' magnitudes, not to the result's: measured against sum |x| |w|
    scale = 1 + x.double().abs() @ weight.double().abs().t() + residual.double().abs()
    expected = {"gelu": torch.nn.functional.gelu(product), "none": product + residual.double()}
    return all(  # about 1e-3 here; a wrong layout or scale is off by tenths
        _agrees(f"fp16 GEMM ({activation})", lambda a=activation: torch.ops.xenc_lab.linear_half(
            x, blocks, exponent, padded, 150, a, residual if a == "none" else None).double() / scale,
            want / scale, torch.finfo(torch.bfloat16).eps, "using the fp32 GEMM")
        for activation, want in expected.items()
    )


def linear_half_cpu(
    x: torch.Tensor,
    blocks: torch.Tensor,
    weight_exponent: int,
    bias: torch.Tensor,
    out_features: int,
    activation: str = "none",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T + bias, then exact GELU (``activation="gelu"``) or ``+ residual``, rounded once to bfloat16, with
    the products and sums in float16 over chunks of 64 consecutive k and the chunks summed in float32: x is (M, K)
    bfloat16 with contiguous columns, each row scaled by a power of two of its own (undone in float32);
    ``blocks``, ``weight_exponent`` and ``bias`` from ``half_blocks``. Callers check ``half_gemm_available()``."""
    return torch.ops.xenc_lab.linear_half(x, blocks, weight_exponent, bias, out_features, activation, residual)
