"""The native packed CPU attention kernel against attention computed by torch, sequence by sequence.

Tolerances: float32 outputs are compared with a float64 reference on the same inputs, within
1e-5 * (1 + |ref|): the kernel computes in float32 throughout, with errors of ~1e-6 (up to ~8e-6 for
head_dim 256, where the float32 dot products are long), as torch's own float32 attention.
bfloat16 (float16) outputs are compared with the float64 reference on the same 16-bit inputs within
1e-2 (2e-3) * (1 + |ref|), and must equal the correctly rounded reference in almost every element: scores,
softmax and the weighted sum stay in float32, so only the final rounding is lost. Where the build runs bf16
attention on the bf16 pair dot product (``kernels.paired_bf16``: AMD cores), the softmax numerators are rounded to
bf16 before they weight the values, and the reference does the same (``kernel_reference``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from xenc_lab.cpu import kernels, native
from xenc_lab.cpu.info import cpu_info

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEAD_DIMS = [16, 32, 64, 80]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # times 1 + |reference|


@pytest.fixture(scope="module")
def attention():
    if not native.available():
        pytest.skip("the native kernels could not be built here (see the 'xenc_lab' warning)")
    return kernels.packed_attention_cpu


def random_lengths(gen: torch.Generator, n: int, high: int = 300) -> list[int]:
    return torch.randint(1, high + 1, (n,), generator=gen).tolist()


def offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def reference(q, k, v, cu_q, cu_k, num_heads, scale, window=None, numerators=None) -> torch.Tensor:
    """float64 attention per sequence and head, with the kernel's conventions (queries are the first tokens).
    ``numerators`` (a dtype): the softmax numerators exp(s - max) rounded to it before they weight the values,
    divided by the sum of the unrounded ones."""
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(q.shape, dtype=torch.float64)
    dh = q.shape[1] // num_heads
    for b in range(len(cu_q) - 1):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        nq, nk = qs.stop - qs.start, ks.stop - ks.start
        if nq == 0:
            continue
        qb, kb, vb = (x.view(-1, num_heads, dh).transpose(0, 1) for x in (q[qs], k[ks], v[ks]))
        scores = qb @ kb.transpose(1, 2) * scale  # (H, nq, nk)
        if window is not None:
            i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
            scores = scores.masked_fill((i - j).abs() > window // 2, float("-inf"))
        if numerators is None:
            weighted = scores.softmax(-1) @ vb
        else:
            e = (scores - scores.amax(-1, keepdim=True)).exp()
            weighted = (e.to(numerators).double() @ vb) / e.sum(-1, keepdim=True)
        out[qs] = weighted.transpose(0, 1).reshape(nq, -1)
    return out


def kernel_reference(q, k, v, cu_q, cu_k, num_heads, scale, window=None) -> torch.Tensor:
    """``reference`` with the kernel's arithmetic here: bf16 numerators in the paired build."""
    numerators = torch.bfloat16 if q.dtype == torch.bfloat16 and kernels.paired_bf16() else None
    return reference(q, k, v, cu_q, cu_k, num_heads, scale, window, numerators)


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.is_contiguous() and out.shape == ref.shape
    err = (out.double() - ref).abs()
    assert (err <= TOLERANCE[out.dtype] * (1 + ref.abs())).all(), f"max abs error {err.max():.3g}"
    if out.dtype != torch.float32:
        exact = (out == ref.to(out.dtype)).double().mean()
        assert exact > 0.99, f"only {exact:.2%} of the elements are the correctly rounded reference"


def fused_qkv(tokens: int, num_heads: int, head_dim: int, dtype, gen, spread: float = 1.0):
    """Column views of one (tokens, 3 * d) tensor, as the models' fused projection produces them."""
    qkv = torch.randn(tokens, 3 * num_heads * head_dim, generator=gen)
    qkv[:, : num_heads * head_dim] *= spread
    return qkv.to(dtype).split(num_heads * head_dim, dim=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_self_attention_matches_reference(attention, dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    lengths = random_lengths(gen, 7)
    cu = offsets(lengths)
    num_heads = 3
    q, k, v = (x.contiguous() for x in fused_qkv(int(cu[-1]), num_heads, head_dim, dtype, gen))
    out = attention(q, k, v, cu, cu, num_heads, head_dim**-0.5)
    assert out.dtype == dtype
    assert_matches(out, kernel_reference(q, k, v, cu, cu, num_heads, head_dim**-0.5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [1, 7, 33, 48, 100, 128, 256])
def test_any_head_dim_up_to_256(attention, dtype, head_dim):
    gen = torch.Generator().manual_seed(1000 + head_dim)
    cu = offsets([1, 17, 40])
    q, k, v = fused_qkv(int(cu[-1]), 2, head_dim, dtype, gen)
    assert_matches(attention(q, k, v, cu, cu, 2, 0.3), kernel_reference(q, k, v, cu, cu, 2, 0.3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_strided_views_of_a_fused_tensor_and_int64_offsets(attention, dtype, head_dim):
    gen = torch.Generator().manual_seed(2000 + head_dim)
    cu = offsets(random_lengths(gen, 5)).long()
    q, k, v = fused_qkv(int(cu[-1]), 4, head_dim, dtype, gen, spread=3.0)  # peaked softmax
    assert q.stride() == (3 * 4 * head_dim, 1)
    assert_matches(attention(q, k, v, cu, cu, 4, head_dim**-0.5), kernel_reference(q, k, v, cu, cu, 4, head_dim**-0.5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("window", [None, 8])
def test_first_token_only(attention, dtype, head_dim, window):
    gen = torch.Generator().manual_seed(3000 + head_dim)
    cu = offsets(random_lengths(gen, 9))
    q, k, v = fused_qkv(int(cu[-1]), 3, head_dim, dtype, gen)
    first = q[cu[:-1].long()]
    cu_first = torch.arange(len(cu), dtype=torch.int32)
    out = attention(first, k, v, cu_first, cu, 3, head_dim**-0.5, window)
    assert_matches(out, kernel_reference(first, k, v, cu_first, cu, 3, head_dim**-0.5, window))
    # Each query's arithmetic does not depend on the other queries computed with it: bitwise equal.
    assert torch.equal(out, attention(q, k, v, cu, cu, 3, head_dim**-0.5, window)[cu[:-1].long()])


def test_bf16_weighted_sums_take_the_numerators_this_build_says(attention):
    """The paired build (AMD) rounds the softmax numerators to bf16 before they weight the values; the widened one
    keeps them fp32. Each build's output is the correctly rounded result of its own arithmetic in almost every
    element and, on flat softmaxes over many keys, visibly not of the other's."""
    gen = torch.Generator().manual_seed(11)
    cu = offsets([300, 257, 120])
    q, k, v = fused_qkv(int(cu[-1]), 2, 32, torch.bfloat16, gen, spread=0.3)  # flat: many numerators count
    out = attention(q, k, v, cu, cu, 2, 32**-0.5)
    rounded = reference(q, k, v, cu, cu, 2, 32**-0.5, numerators=torch.bfloat16)
    unrounded = reference(q, k, v, cu, cu, 2, 32**-0.5)
    agree = {
        name: (out == ref.to(out.dtype)).double().mean().item()
        for name, ref in [("rounded", rounded), ("unrounded", unrounded)]
    }
    ours, other = ("rounded", "unrounded") if kernels.paired_bf16() else ("unrounded", "rounded")
    assert agree[ours] > 0.99 and agree[other] < 0.95, agree
    assert_matches(out, kernel_reference(q, k, v, cu, cu, 2, 32**-0.5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scores_far_apart_give_numerators_of_exactly_zero(attention, dtype):
    """Keys hundreds below the best score of their query (log2 gaps past 125, where 2^gap would be subnormal): the
    kernel's exp2 sends their numerators to exactly 0 through its underflow mask, not through a subnormal or a
    wrapped exponent, and the rest of the softmax is untouched. The far keys' scores are a large exact term
    (10 x -200 in one column) plus an ordinary dot product, so float32 scores stay exact enough to compare."""
    gen = torch.Generator().manual_seed(12)
    cu = offsets([3, 40, 77, 300])
    num_heads, dh = 2, 32
    q, k, v = (x.contiguous() for x in fused_qkv(int(cu[-1]), num_heads, dh, torch.float32, gen))
    far = torch.rand(k.shape[0], generator=gen) < 0.5
    for h in range(num_heads):
        q[:, h * dh] = 10.0
        k[:, h * dh] = torch.where(far, -200.0, 0.0)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scores = q[:40, :dh].double() @ k[:40, :dh].double().T * dh**-0.5
    assert ((scores.amax(1, keepdim=True) - scores) * 1.4427 > 250).any()  # the case under test occurs
    out = attention(q, k, v, cu, cu, num_heads, dh**-0.5)
    assert_matches(out, kernel_reference(q, k, v, cu, cu, num_heads, dh**-0.5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_long_sequence_split_into_query_blocks(attention, dtype):
    gen = torch.Generator().manual_seed(8)
    cu = offsets([1000])
    q, k, v = fused_qkv(1000, 2, 64, dtype, gen)
    assert_matches(attention(q, k, v, cu, cu, 2, 0.125), kernel_reference(q, k, v, cu, cu, 2, 0.125))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 1, 6, 33, 128, 1000])
def test_sliding_window(attention, dtype, window):
    gen = torch.Generator().manual_seed(4000 + window)
    cu = offsets([*random_lengths(gen, 5), 300])
    q, k, v = fused_qkv(int(cu[-1]), 2, 32, dtype, gen)
    out = attention(q, k, v, cu, cu, 2, 32**-0.5, window=window)
    assert_matches(out, kernel_reference(q, k, v, cu, cu, 2, 32**-0.5, window=window))


def check_filler_rows_are_zero_and_never_read(attention, dtype, assert_close=None) -> None:
    """Rows past every sequence (NaN here) come back zero and change no sequence's result."""
    gen = torch.Generator().manual_seed(5)
    cu = offsets([5, 70, 19])
    q, k, v = fused_qkv(int(cu[-1]) + 13, 2, 32, dtype, gen)
    for x in (q, k, v):
        x[int(cu[-1]) :] = float("nan")
    out = attention(q, k, v, cu, cu, 2, 0.2)
    assert torch.equal(out[int(cu[-1]) :], torch.zeros(13, 64, dtype=dtype))
    (assert_close or assert_matches)(out[: int(cu[-1])], kernel_reference(q, k, v, cu, cu, 2, 0.2)[: int(cu[-1])])


@pytest.mark.parametrize("dtype", DTYPES)
def test_filler_rows_are_zero_and_never_read(attention, dtype):
    check_filler_rows_are_zero_and_never_read(attention, dtype)


def test_empty_sequences_and_an_empty_batch(attention):
    gen = torch.Generator().manual_seed(6)
    cu = offsets([0, 3, 0, 0, 9, 0])
    q, k, v = fused_qkv(int(cu[-1]), 2, 16, torch.float32, gen)
    assert_matches(attention(q, k, v, cu, cu, 2, 0.25), kernel_reference(q, k, v, cu, cu, 2, 0.25))
    none = torch.zeros(1, dtype=torch.int32)
    assert torch.equal(attention(q, k, v, none, none, 2, 0.25), torch.zeros(12, 32))


def check_results_do_not_depend_on_threads_or_batch_neighbours(attention, dtype) -> None:
    """Bitwise: one thread gives what all do, and a sequence alone what it gives among others."""
    gen = torch.Generator().manual_seed(7)
    lengths = [*random_lengths(gen, 12), 0]
    cu = offsets(lengths)
    q, k, v = fused_qkv(int(cu[-1]), 4, 32, dtype, gen)
    out = attention(q, k, v, cu, cu, 4, 0.17)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(out, attention(q, k, v, cu, cu, 4, 0.17))
    finally:
        torch.set_num_threads(threads)
    b = 5  # one sequence on its own
    rows = slice(int(cu[b]), int(cu[b + 1]))
    alone = offsets([lengths[b]])
    assert torch.equal(out[rows], attention(q[rows], k[rows], v[rows], alone, alone, 4, 0.17))


def test_results_do_not_depend_on_threads_or_batch_neighbours(attention):
    check_results_do_not_depend_on_threads_or_batch_neighbours(attention, torch.float32)


def test_invalid_inputs_are_rejected(attention):
    q = torch.randn(10, 64)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="dtype"):
        attention(q, q.bfloat16(), q, cu, cu, 2, 0.1)
    with pytest.raises(RuntimeError, match="num_heads"):
        attention(q, q, q, cu, cu, 3, 0.1)
    with pytest.raises(RuntimeError, match="head_dim"):
        attention(torch.randn(4, 512), torch.randn(4, 512), torch.randn(4, 512), cu[:2], cu[:2], 1, 0.1)
    with pytest.raises(RuntimeError, match="keys"):
        attention(q, q, q, cu, torch.tensor([0, 4, 9], dtype=torch.int32), 2, 0.1)
    with pytest.raises(RuntimeError, match="within"):
        attention(q, q, q, torch.tensor([0, 11], dtype=torch.int32), torch.tensor([0, 11]), 2, 0.1)
    with pytest.raises(RuntimeError, match="columns"):
        attention(q.t().contiguous().t(), q, q, cu, cu, 2, 0.1)
    with pytest.raises(RuntimeError, match="float32, bfloat16 and float16"):
        attention(q.double(), q.double(), q.double(), cu, cu, 2, 0.1)
    with pytest.raises(ValueError, match="window"):
        attention(q, q, q, cu, cu, 2, 0.1, window=-2)


def check_traceable_by_torch_compile(op, attention, dtype) -> None:
    """The op passes torch's operator checks (fake tensor shapes included), and ``attention`` (which calls it)
    compiles into one graph that computes what it computes eagerly."""
    qkv = torch.randn(40, 192).to(dtype)
    cu = torch.tensor([0, 4, 40], dtype=torch.int32)
    q, k, v = qkv.split(64, dim=1)
    torch.library.opcheck(op.default, (q, k, v, cu, cu, 2, 0.1, -1))

    def layer(qkv, cu):
        q, k, v = qkv.split(64, dim=1)
        return attention(q, k, v, cu, cu, 2, 0.1) * 2

    assert torch.equal(torch.compile(layer, fullgraph=True)(qkv, cu), layer(qkv, cu))


@pytest.mark.slow
def test_traceable_by_torch_compile(attention):
    check_traceable_by_torch_compile(torch.ops.xenc_lab.packed_attention, attention, torch.float32)


def call_in_subprocess(env: dict[str, str]) -> tuple[bool, list[str]]:
    """(every result None, the 'xenc_lab' log records) of three packed_attention_cpu calls in a fresh process."""
    code = textwrap.dedent(
        """
        import json, logging, torch
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("xenc_lab").addHandler(handler)
        from xenc_lab.cpu.kernels import packed_attention_cpu
        q, cu = torch.randn(4, 8), torch.tensor([0, 4])
        results = [packed_attention_cpu(q, q, q, cu, cu, 2, 0.5) for _ in range(3)]
        print(json.dumps([all(r is None for r in results), [f"{r.levelname} {r.getMessage()}" for r in records]]))
        """
    )
    command = [sys.executable, "-c", code]
    run = subprocess.run(command, check=False, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return tuple(json.loads(run.stdout.splitlines()[-1]))


@pytest.mark.slow
def test_disabled_by_environment_variable():
    all_none, records = call_in_subprocess({"XENC_LAB_NO_KERNELS": "1"})
    assert all_none and len(records) == 1 and records[0].startswith("WARNING") and "XENC_LAB_NO_KERNELS" in records[0]


@pytest.mark.slow
def test_no_compiler_means_none_and_one_warning(tmp_path):
    all_none, records = call_in_subprocess({"CXX": str(tmp_path / "no-such-c++"), "XENC_LAB_CACHE": str(tmp_path)})
    assert all_none and len(records) == 1 and records[0].startswith("WARNING") and "unavailable" in records[0]


@pytest.mark.slow
def test_a_build_killed_halfway_does_not_block_the_next(tmp_path):
    """The first use builds the library; a process killed during that build (a notebook kernel restarted) must
    leave nothing that makes the next process wait or fail."""
    import signal
    import time

    # -O0: this is about the build's files, not the code's speed, and halves the build's time
    env = {**os.environ, "XENC_LAB_CACHE": str(tmp_path), "XENC_LAB_KERNEL_CFLAGS": "-O0"}
    code = "import torch; from xenc_lab.cpu.native import available; print(available())"
    first = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(tmp_path.glob("kernels/*/*/build-*/*")) and time.time() < deadline:  # the build has begun
        time.sleep(0.2)
    time.sleep(1.0)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert list(tmp_path.glob("kernels/*/*/build-*")), "the killed build left no scratch directory to test with"
    run = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.split()[-1] == "True", run.stderr[-2000:]
    assert len(list(tmp_path.glob("kernels/*/*/xenc_lab_kernels-*.so"))) == 1


# The builds other CPUs get: with AVX512-BF16, bf16 attention on the pair dot product (AMD cores) or on fp32 FMAs
# (Intel cores), and the generic vectors (no AVX-512: AVX2, NEON, ...). This machine builds them with extra flags
# and runs the numerical tests above on them, with the decoder kernels' and the int8 GEMM's (the int8 code a CPU
# with AVX-VNNI alone runs, but its products). (build: flags, the CPU flag it needs, whether it is this CPU's own)
OTHER_BUILDS = {
    "bf16-pair-dot": ("-DXENC_PAIRED_BF16=1", "avx512_bf16", kernels.paired_bf16),
    "bf16-widened": ("-DXENC_PAIRED_BF16=0", "avx512_bf16", lambda: not kernels.paired_bf16()),
    "generic-vectors": ("-mno-avx512f", "avx512f", lambda: False),
}


@pytest.mark.slow
@pytest.mark.parametrize("build", list(OTHER_BUILDS))
def test_the_builds_of_other_cpus(attention, build, monkeypatch):
    flags, needs, own = OTHER_BUILDS[build]
    if needs not in cpu_info().flags:
        pytest.skip(f"this CPU has no {needs}: its default build is already the one under test")
    if own():
        pytest.skip(f"{build} is this CPU's default build, under test already")
    monkeypatch.setenv("XENC_LAB_KERNEL_CFLAGS", flags)
    library = native._library_path(*native._compiler_flags())
    numerical = "not subprocess and not environment and not compiler and not killed and not other_cpus and not traceable"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         str(Path(__file__).with_name("test_decoder_kernels.py")), str(Path(__file__).with_name("test_int8_gemm.py")),
         "-k", numerical],
        check=False,
        env={**os.environ, "XENC_LAB_KERNEL_CFLAGS": flags},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert library.exists(), f"the {build} build was not made at {library}"
    passed = int(run.stdout.strip().splitlines()[-1].split(" passed")[0].split()[-1])
    assert passed >= 80, run.stdout[-500:]
