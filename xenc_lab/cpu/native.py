"""The build of the native CPU kernels (``csrc/``): compiled on first use, cached on disk, loaded once per process.

The extension is built with ``-O3 -march=native`` into ``$XENC_LAB_CACHE/kernels/<torch version>/<cpu>``, once per
kind of CPU and version of the sources. Each build runs in a directory of its own and publishes the library with an
atomic rename, so concurrent first uses do not wait on each other and a killed build blocks nothing. Where it cannot
be built (no compiler, no ninja) or ``XENC_LAB_NO_KERNELS=1``, one warning is logged and ``available()`` is False.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from .. import settings
from .info import cpu_info

logger = logging.getLogger("xenc_lab")

_CSRC = Path(__file__).parent.parent / "csrc"
# The extension's translation units, compiled together into one library (the headers next to them are included).
_SOURCES = [
    _CSRC / name
    for name in ("ops.cpp", "checks.cpp", "ops_attention.cpp", "attention.cpp", "attention_tiles.cpp", "folded_pool.cpp",
                 "layer_norm.cpp", "rms_norm.cpp", "gemm_f32.cpp", "gemm_half.cpp", "gemm_int8.cpp")
]
_NAME = "xenc_lab_kernels"

_lock = threading.RLock()  # reentrant: a check may ask for another check's answer
# Answers found once per process: "loaded" (the extension's ops are in torch.ops.xenc_lab), and the self-checks'.
_answers: dict[object, bool] = {}


def once(key: object, find) -> bool:
    """``find()``'s answer for ``key``, found by the first caller (others wait for it) and kept."""
    if key not in _answers:
        with _lock:
            if key not in _answers:
                _answers[key] = find()
    return _answers[key]


def build_directory() -> Path:
    return settings.cache_root() / "kernels" / torch.__version__ / _cpu_tag()


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
    """(cflags, ldflags). -ffp-contract=fast lets the generic-vector kernel use FMA instructions. With torch's OpenMP
    backend the extension is compiled and linked with OpenMP too (at::parallel_for is inline), sharing torch's libgomp.
    XENC_PAIRED_BF16: bf16 attention on the bf16 pair dot product, on AMD cores only (docs/cpu-backends.md)."""
    paired = cpu_info().vendor == "AuthenticAMD"
    cflags, ldflags = ["-O3", "-march=native", "-ffp-contract=fast", f"-DXENC_PAIRED_BF16={int(paired)}"], []
    # Flags of one's own, appended (later ones win): the tests build the code paths of other CPUs this way.
    cflags += (settings.get("XENC_LAB_KERNEL_CFLAGS") or "").split()
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    return cflags, ldflags


def _packed_attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, num_heads, scale, window):
    return q.new_empty(q.shape)


def _paged_attention_fake(q, k, v, k_cache, v_cache, key_index, cu_seqlens_q, cu_seqlens_k, num_heads, scale):
    return q.new_empty(q.shape)


def _linear_fake(x, blocks, bias, out_features, activation, residual):
    return x.new_empty((x.shape[0], out_features))


def _linear_int8_fake(x, blocks, correction, weight_scale, bias, out_features, activation, residual):
    return x.new_empty((x.shape[0], out_features))


def _linear_half_fake(x, blocks, weight_exponent, bias, out_features, activation, residual):
    return x.new_empty((x.shape[0], out_features))



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
    """Where the built library lives: named by a hash of every file in csrc/ (headers included) and of the flags,
    so an edit means a new build."""
    digest = hashlib.sha256()
    for source in sorted(path for path in _CSRC.rglob("*") if path.is_file()):
        digest.update(source.relative_to(_CSRC).as_posix().encode())
        digest.update(source.read_bytes())
    digest.update(" ".join(cflags + ldflags).encode())
    return build_directory() / f"{_NAME}-{digest.hexdigest()[:16]}.so"


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
    if settings.get("XENC_LAB_NO_KERNELS") == "1":
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
        torch.library.register_fake("xenc_lab::paged_attention", _paged_attention_fake)
        torch.library.register_fake("xenc_lab::layer_norm", lambda x, weight, bias, eps: x.new_empty(x.shape))
        torch.library.register_fake("xenc_lab::rms_norm", lambda x, weight, eps: x.new_empty(x.shape))
        torch.library.register_fake("xenc_lab::rope", lambda x, weight, eps, cos, sin: x.new_empty(x.shape))
        torch.library.register_fake("xenc_lab::linear_widened", _linear_fake)
        torch.library.register_fake("xenc_lab::linear_f32", _linear_fake)
        torch.library.register_fake("xenc_lab::linear_half", _linear_half_fake)
        torch.library.register_fake("xenc_lab::linear_int8", _linear_int8_fake)
        return True
    except Exception as e:  # any failure to build or load means: no kernels, use the fallback
        logger.warning("xenc_lab native kernels unavailable (%s); using torch ops instead", reason(e))
        logger.debug("xenc_lab native kernel build failure", exc_info=True)
        return False


def reason(e: Exception) -> str:
    """One line on why the build failed. A failed build's message is ninja's log: skip its progress lines and the
    echoed commands, and prefer a compiler error line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    progress = ("Error building extension", "[", "FAILED:", "ninja:")
    commands = (" -MMD ", " -shared ")
    informative = [line for line in lines if not line.startswith(progress) and not any(c in line for c in commands)]
    errors = [line for line in informative if "error" in line.lower()]
    line = (errors or informative or lines or [""])[0]
    return f"{type(e).__name__}: {line[:300]}"


@torch.compiler.assume_constant_result  # a constant to torch.compile: a build cannot be traced
def available() -> bool:
    """Whether the extension is loaded, building (first time on this kind of CPU) and loading it on the first call of
    the process. ``choices.resolve`` calls it when a Scorer loads onto the CPU."""
    return once("loaded", _build)


