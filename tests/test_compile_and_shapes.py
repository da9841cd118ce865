"""Page-quantized batch shapes (CPU buckets, CUDA graphs, compiled forwards): few shapes, same scores."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from xenc_lab import Scorer
from xenc_lab.batch import MIN_ROWS, pack
from xenc_lab.bench.workloads import make_pairs
from xenc_lab.choices import resolve
from xenc_lab.models import PackedModel
from xenc_lab.pages import ATTENTION_ALIGN, bucket_shape, pages_for, plan_batches
from xenc_lab.runner import ModelRunner
from xenc_lab.tokenize import Encodings

from .conftest import PAIRS


@given(
    lengths=st.lists(st.integers(1, 512), min_size=1, max_size=64),
    page_size=st.sampled_from([1, 4, 8, 12, 16, 64]),
    budget=st.sampled_from([1000, 4096, 8192]),
    bucket_length=st.booleans(),
)
def test_bucket_shape_holds_the_batch_in_whole_pages_within_the_budget(lengths, page_size, budget, bucket_length):
    max_pages = pages_for(budget, page_size)
    tokens, pairs, longest = sum(lengths), len(lengths), max(lengths)
    if pages_for(tokens, page_size) > max_pages:
        return
    T, B, L = bucket_shape(tokens, pairs, longest, page_size, max_pages, bucket_length)
    assert T >= tokens and T % page_size == 0 and T <= max_pages * page_size
    assert T < pages_for(tokens, page_size) * page_size + max(1, max_pages // 8) * page_size  # filler < one step
    assert B >= pairs and B < 2 * pairs
    # L holds the slot past the longest pair that pack lays out, in its alignment, whatever the page size
    exact = pages_for(longest + 1, ATTENTION_ALIGN) * ATTENTION_ALIGN
    assert L >= exact and L % ATTENTION_ALIGN == 0
    assert L <= 2 * max(longest, page_size) + page_size + ATTENTION_ALIGN if bucket_length else L == exact
    enc = Encodings(np.ones(tokens, dtype=np.int64), None, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    batch = pack(enc, np.arange(pairs), page_size, 0, (T, B, L))
    assert (batch.input_ids.shape[0], batch.seq_lens.shape[0], batch.max_seqlen) == (T, max(B, MIN_ROWS), L)


@pytest.mark.parametrize("bucket_length", [True, False])
def test_a_long_mixed_run_meets_a_handful_of_shapes(bucket_length):
    rng = np.random.default_rng(0)  # 3,000 pair lengths shaped like the mixed workload: most short, a tail to 512
    lengths = np.minimum(np.concatenate([rng.integers(20, 90, 1500), rng.integers(90, 300, 1050), rng.integers(300, 700, 450)]), 512)
    batches = plan_batches(lengths, 16, 256)
    shapes = {bucket_shape(int(lengths[b].sum()), len(b), int(lengths[b].max()), 16, 256, bucket_length) for b in batches}
    plain = {(pages_for(int(lengths[b].sum()), 16), len(b), int(lengths[b].max())) for b in batches}
    assert len({T for T, _, _ in shapes}) <= 8 < len({T for T, _, _ in plain}) / 2  # oneDNN meets few row counts
    assert len({B for _, B, _ in shapes}) <= 9 < len({B for _, B, _ in plain})
    if bucket_length:  # one CUDA graph per shape
        assert len(shapes) <= 16 and 3 * len(shapes) < len(plain), (len(shapes), len(plain))


class _Stub(PackedModel):
    """A model with one parameter on the CPU: enough for a runner to plan and shape batches."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)


def _runner(device: str, compile: bool = False) -> ModelRunner:
    """A runner with the choices a Scorer on ``device`` makes (no GPU is asked anything: no head shape)."""
    return ModelRunner(_Stub(), resolve(torch.device(device), torch.float32, None, compile))


def test_the_runner_buckets_cpu_batches_unless_asked_not_to_and_cuda_graph_batches_only(monkeypatch):
    lengths = np.array([300, 200, 41])
    cpu = _runner("cpu")
    assert cpu.batch_shapes == "bucketed" and cpu.batch_shape(lengths, 16, 256) == (1024, 4, 304)
    assert _runner("cpu", compile=True).batch_shapes == "bucketed"
    assert _runner("cuda").batch_shape(lengths, 16, 256) is None
    graphs = _runner("cuda", compile=True)
    assert graphs.batch_shapes == "graphs" and graphs.batch_shape(lengths, 16, 256) == (1024, 4, 512)
    monkeypatch.setenv("XENC_LAB_CPU_BATCH_SHAPES", "exact")
    assert _runner("cpu").batch_shape(lengths, 16, 256) is None
    monkeypatch.setenv("XENC_LAB_CPU_BATCH_SHAPES", "static")
    with pytest.raises(ValueError, match="XENC_LAB_CPU_BATCH_SHAPES must be one of bucketed, exact"):
        _runner("cpu")


@pytest.mark.slow
def test_cpu_scoring_runs_on_bucket_shapes_and_scores_as_exact_shapes_do(tiny_dir, monkeypatch):
    """oneDNN keeps memory for each GEMM shape it meets: a CPU run meets at most 8 token counts per budget."""
    pairs = PAIRS + make_pairs("mixed", 120, seed=5)
    bucketed = Scorer(tiny_dir, device="cpu", max_batch_tokens=1024)
    scores = bucketed.predict(pairs, activation_fn=torch.nn.Identity(), batch_size=7)
    token_counts = {T for T, _, _ in bucketed.runner.shapes}
    assert token_counts <= {128 * k for k in range(1, 9)} and len(token_counts) >= 3, token_counts
    assert all(B == 16 or (B & (B - 1) == 0 and B > 16) for _, B, _ in bucketed.runner.shapes)
    monkeypatch.setenv("XENC_LAB_CPU_BATCH_SHAPES", "exact")
    exact = Scorer(tiny_dir, device="cpu", max_batch_tokens=1024)
    np.testing.assert_allclose(exact.predict(pairs, activation_fn=torch.nn.Identity(), batch_size=7), scores, atol=1e-5, rtol=0)
    assert len({T for T, _, _ in exact.runner.shapes}) > len(token_counts)


def test_padding_a_batch_to_a_bucket_shape_changes_no_logit(scorer):
    enc = scorer.tokenizer([p[0] for p in PAIRS], [p[1] for p in PAIRS])
    order = np.argsort(-enc.lengths, kind="stable")
    lens = enc.lengths[order]
    exact = scorer.runner(pack(enc, order, 16, scorer.pad_token_id))
    shape = bucket_shape(int(lens.sum()), len(order), int(lens.max()), 16, 64)
    padded = scorer.runner(pack(enc, order, 16, scorer.pad_token_id, shape))
    assert padded.shape == exact.shape == (len(PAIRS), 1)
    torch.testing.assert_close(padded, exact, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_compiled_scorer_equals_eager_and_compiles_one_graph_for_every_batch_shape(tiny_dir):
    eager = Scorer(tiny_dir, device="cpu")
    compiled = Scorer(tiny_dir, device="cpu", compile=True, max_batch_tokens=256)
    assert compiled.runner.compiled and compiled.runner.batch_shapes == "bucketed"
    pairs = PAIRS + make_pairs("short", 40, seed=2)
    np.testing.assert_allclose(compiled.predict(pairs, batch_size=8), eager.predict(pairs), atol=1e-5, rtol=0)
    graphs, shapes = compiled.runner.graphs, set(compiled.runner.shapes)
    assert 1 <= graphs <= 2 and len(shapes) >= 3, (graphs, shapes)
    assert all(T % 16 == 0 for T, _, _ in shapes)
    # New pair counts and lengths reuse the graph: the CPU graph's sizes are symbolic.
    more = make_pairs("mixed", 23, seed=3)
    np.testing.assert_allclose(compiled.predict(more), eager.predict(more), atol=1e-5, rtol=0)
    assert compiled.runner.graphs == graphs and len(compiled.runner.shapes) > len(shapes)


def test_compiling_for_cuda_asks_for_cuda_graphs_and_eager_roundings_in_one_set_of_options(monkeypatch):
    """Runs anywhere: torch.compile refuses a mode and options together, at the call, before any GPU is touched."""
    cuda = _runner("cuda", compile=True)
    assert cuda.batch_shapes == "graphs" and cuda.compile_options["triton.cudagraphs"] is True
    cpu = _runner("cpu", compile=True)
    assert cpu.batch_shapes == "bucketed" and "triton.cudagraphs" not in cpu.compile_options
    from torch._inductor import config as inductor_config

    if hasattr(inductor_config, "emulate_precision_casts"):
        assert cuda.compile_options["emulate_precision_casts"] and cpu.compile_options["emulate_precision_casts"]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cuda_scores_equal_crossencoder(tiny_dir, dtype):
    from sentence_transformers import CrossEncoder

    ours = Scorer(tiny_dir, device="cuda", dtype=dtype).predict(PAIRS, activation_fn=torch.nn.Identity())
    exact = CrossEncoder(str(tiny_dir), device="cpu").predict(PAIRS, activation_fn=torch.nn.Identity())
    tol = 1e-4 if dtype == "float32" else 5e-2
    np.testing.assert_allclose(ours, exact, atol=tol, rtol=tol)


@pytest.mark.cuda
def test_cuda_compiled_with_cuda_graphs_equals_eager(tiny_dir):
    eager = Scorer(tiny_dir, device="cuda", dtype="bfloat16")
    graphs = Scorer(tiny_dir, device="cuda", dtype="bfloat16", compile=True)
    pairs = PAIRS + make_pairs("mixed", 64, seed=4)
    np.testing.assert_allclose(graphs.predict(pairs), eager.predict(pairs), atol=2e-2, rtol=2e-2)


def test_every_tensor_of_a_bucket_shaped_batch_has_a_shape_set_by_the_bucket_alone():
    """A compiled forward guards on tensor shapes: nothing may depend on how many pairs fill the bucket."""
    from xenc_lab.tokenize import Encodings

    enc = Encodings(np.arange(1, 41, dtype=np.int64), None, np.arange(0, 41, 4, dtype=np.int64))  # 10 pairs of 4
    shape = (64, 32, 16)
    batches = [pack(enc, np.arange(n), 16, 0, shape) for n in (3, 7, 10)]
    names = ("input_ids", "positions", "cu_seqlens", "cu_first", "seq_lens", "pad_index", "unpad_index", "key_mask")
    for name in (*names, "first_index"):
        assert len({tuple(getattr(b, name).shape) for b in batches}) == 1, name
    assert batches[0].cu_first.tolist() == [0, 1, 2, 3] + [3] * 29  # one query per pair, none for the filler


def test_varlen_takes_a_scale_and_a_window_only_where_torchs_varlen_attn_has_the_argument(monkeypatch):
    from xenc_lab.ops import attention

    calls = []  # a stand-in kernel with neither argument, as torch's first varlen_attn had it
    monkeypatch.setattr(attention, "_varlen_attn", lambda *args, **kwargs: calls.append(kwargs))
    monkeypatch.setattr(attention, "_VARLEN_TAKES_SCALE", False)
    monkeypatch.setattr(attention, "_VARLEN_TAKES_WINDOW", False)
    monkeypatch.setattr(attention, "_FLASH_CAPABLE", {0: True, 1: False})  # an Ampere-or-newer GPU and an older one
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert attention.varlen_runs(cuda0, torch.float16, 64) and attention.varlen_runs(cuda0, torch.bfloat16, 64)
    assert attention.varlen_takes(64) and attention.varlen_takes(64, 64**-0.5)
    assert not attention.varlen_takes(64, 0.1)  # another scale: the padded SDPA path
    assert not attention.varlen_takes(64, None, 128)  # sliding window
    assert not attention.varlen_runs(cuda0, torch.float32, 64)
    assert not attention.varlen_runs(torch.device("cpu"), torch.float16, 64)
    # flash attention needs compute capability 8.0 and a head dim that is a multiple of 8, at most 256
    assert not attention.varlen_runs(cuda1, torch.float16, 64)
    assert attention.varlen_runs(cuda0, torch.float16, 256) and not attention.varlen_runs(cuda0, torch.float16, 320)
    assert not attention.varlen_runs(cuda0, torch.float16, 36)
    attention._varlen(None, None, None, None, None, 1, 1, 64**-0.5)
    monkeypatch.setattr(attention, "_VARLEN_TAKES_SCALE", True)
    monkeypatch.setattr(attention, "_VARLEN_TAKES_WINDOW", True)
    assert attention.varlen_takes(64, 0.1, 128)
    attention._varlen(None, None, None, None, None, 1, 1, 0.1)
    attention._varlen(None, None, None, None, None, 1, 1, None, 128)  # |i - j| <= 64 on either side
    assert calls == [{}, {"scale": 0.1}, {"window_size": (64, 64)}]


def test_flash_capability_is_read_once_per_device_from_its_compute_capability(monkeypatch):
    from xenc_lab.ops import attention

    reads = []
    monkeypatch.setattr(attention, "_FLASH_CAPABLE", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: reads.append(i) or {0: (9, 0), 1: (7, 5)}[i])
    assert attention.flash_capable(torch.device("cuda", 0)) and not attention.flash_capable(torch.device("cuda", 1))
    assert attention.flash_capable(torch.device("cuda", 0)) and reads == [0, 1]


@pytest.fixture
def varlen_on_cpu(monkeypatch):
    """A function that gives torch's own varlen_attn a CPU kernel (the stand-in of test_layers) and returns its calls,
    and a function that puts a Scorer's attention on it, with the choices CUDA makes: the CUDA path's glue,
    through the real wrapper and op as torch.compile sees them."""
    from torch.nn.attention import varlen

    from .test_attention import varlen_attn_on_the_cpu

    calls = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, scale=None, window_size=None, enable_gqa=False,
               seqused_k=None, block_table=None, num_splits=None):
        assert not is_causal and not enable_gqa and seqused_k is None and block_table is None
        calls.append((max_q, max_k))
        window = tuple(window_size) if window_size is not None else (-1, -1)
        out = varlen_attn_on_the_cpu(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window)
        return out, q.new_zeros(q.shape[1], q.shape[0], dtype=torch.float32), q.new_zeros(2, dtype=torch.uint64)

    def on_varlen(scorer: Scorer) -> Scorer:
        varlen._varlen_attn.register_kernel("cpu")(kernel)  # only calls that would fail otherwise reach it
        choices = dataclasses.replace(scorer.choices, attention="varlen", first_token_kv="projected")
        scorer.choices = scorer.runner.choices = choices
        return scorer

    return on_varlen, calls


@pytest.mark.slow
def test_the_cuda_paths_glue_through_torchs_varlen_attn_eager_bucketed_and_compiled_equals_the_cpu_path(
        tiny_dir, varlen_on_cpu):
    """What CUDA runs, but for CUDA graphs and flash attention's own kernel: torch's varlen_attn on the packed
    stream, the first-token attention, batches padded to bucket shapes, and torch.compile over them with symbolic
    sizes. Filler sequences in a bucket come back NaN from the stand-in: no pair may read them. The tolerance is
    float32's: SDPA per pair sums in another order than the CPU kernel, and the last layer projects its keys and
    values here instead of folding them (1.2e-5 seen on logits up to 6)."""
    ATOL = 5e-5
    pairs = PAIRS + make_pairs("mixed", 40, seed=4)
    want = Scorer(tiny_dir, device="cpu").predict(pairs, activation_fn=torch.nn.Identity())  # the CPU path
    on_varlen, calls = varlen_on_cpu
    eager = on_varlen(Scorer(tiny_dir, device="cpu", max_batch_tokens=256))
    np.testing.assert_allclose(eager.predict(pairs, activation_fn=torch.nn.Identity()), want, rtol=0, atol=ATOL)
    assert calls, "attention must have run through varlen_attn"
    eager.runner.batch_shapes = "graphs"  # pad to bucket shapes, as compile=True on CUDA does
    np.testing.assert_allclose(eager.predict(pairs, activation_fn=torch.nn.Identity()), want, rtol=0, atol=ATOL)
    compiled = on_varlen(Scorer(tiny_dir, device="cpu", compile=True, max_batch_tokens=256))
    compiled.runner.batch_shapes = "graphs"
    calls.clear()
    np.testing.assert_allclose(compiled.predict(pairs, activation_fn=torch.nn.Identity()), want, rtol=0, atol=ATOL)
    assert calls and compiled.runner.graphs <= 2 < len(compiled.runner.shapes)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "pads"), [("bert", False), ("distilbert", False), ("modernbert-cls", False), ("modernbert-mean", False), ("deberta-v3", True)]
)
def test_a_model_pads_pairs_where_its_attention_lays_them_out_padded(name, pads, tmp_path, monkeypatch):
    """Attention on the packed stream (the CPU kernel) leaves batches free to mix lengths; SDPA and DeBERTa's
    relative positions lay the pairs out (pairs, longest pair), and their batches keep ATTENTION_SLACK."""
    from xenc_lab.zoo.encoders import build_model
    from xenc_lab.cpu import native

    if not native.available():
        pytest.skip("the CPU kernel could not be built here: attention takes SDPA")
    path = build_model(name, tmp_path)
    monkeypatch.setenv("XENC_LAB_CPU_ATTENTION", "kernel")
    assert Scorer(path, device="cpu").runner.pads_pairs is pads
    monkeypatch.setenv("XENC_LAB_CPU_ATTENTION", "sdpa")
    assert Scorer(path, device="cpu").runner.pads_pairs is True


@pytest.mark.slow
def test_batches_on_the_packed_stream_fill_the_budget_and_score_as_slack_bounded_ones(tiny_dir):
    from xenc_lab.cpu import native

    if not native.available():
        pytest.skip("the CPU kernel could not be built here: attention takes SDPA")
    pairs = PAIRS + make_pairs("mixed", 150, seed=6)
    packed = Scorer(tiny_dir, device="cpu", max_batch_tokens=1024)
    bounded = Scorer(tiny_dir, device="cpu", max_batch_tokens=1024)
    assert packed.runner.pads_pairs is False
    bounded.runner.pads_pairs = True  # as a model on SDPA would plan
    lengths = packed.tokenizer([a for a, _ in pairs], [b for _, b in pairs]).lengths
    fewer, more = packed.runner.plan(lengths, 16, 64), bounded.runner.plan(lengths, 16, 64)
    assert len(fewer) < len(more), (len(fewer), len(more))
    assert [b.tolist() for b in fewer] == [b.tolist() for b in plan_batches(lengths, 16, 64, slack=None)]
    np.testing.assert_allclose(packed.predict(pairs), bounded.predict(pairs), atol=1e-6, rtol=0)
