"""Page-quantized shapes for compiled forwards: few shapes, same scores."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from xenc_lab import Scorer
from xenc_lab.batch import pack
from xenc_lab.pages import bucket_shape, pages_for, plan_batches
from xenc_lab.workloads import make_pairs

from .conftest import PAIRS


@given(
    lengths=st.lists(st.integers(1, 512), min_size=1, max_size=64),
    page_size=st.sampled_from([1, 8, 16, 64]),
)
def test_bucket_shape_holds_the_batch_in_whole_pages_within_the_budget(lengths, page_size):
    max_pages = pages_for(8192, page_size)
    tokens, pairs, longest = sum(lengths), len(lengths), max(lengths)
    if pages_for(tokens, page_size) > max_pages:
        return
    T, B, L = bucket_shape(tokens, pairs, longest, page_size, max_pages)
    assert T >= tokens and T % page_size == 0 and T <= max_pages * page_size
    assert B >= pairs and B < 2 * pairs
    assert L > longest and L % page_size == 0 and L <= 2 * max(longest, page_size) + page_size


def test_a_long_mixed_run_meets_a_handful_of_shapes():
    rng = np.random.default_rng(0)  # 3,000 pair lengths shaped like the mixed workload: most short, a tail to 512
    lengths = np.minimum(np.concatenate([rng.integers(20, 90, 1500), rng.integers(90, 300, 1050), rng.integers(300, 700, 450)]), 512)
    batches = plan_batches(lengths, 16, 512)
    shapes = {bucket_shape(int(lengths[b].sum()), len(b), int(lengths[b].max()), 16, 512) for b in batches}
    plain = {(pages_for(int(lengths[b].sum()), 16), len(b), int(lengths[b].max())) for b in batches}
    assert len(shapes) <= 16 and 3 * len(shapes) < len(plain), (len(shapes), len(plain))


def test_padding_a_batch_to_a_bucket_shape_changes_no_logit(scorer):
    enc = scorer.tokenizer([p[0] for p in PAIRS], [p[1] for p in PAIRS])
    order = np.argsort(-enc.lengths, kind="stable")
    lens = enc.lengths[order]
    exact = scorer.runner(pack(enc, order, 16, scorer.pad_token_id))
    shape = bucket_shape(int(lens.sum()), len(order), int(lens.max()), 16, 64)
    padded = scorer.runner(pack(enc, order, 16, scorer.pad_token_id, shape))
    assert padded.shape == exact.shape == (len(PAIRS), 1)
    torch.testing.assert_close(padded, exact, atol=1e-6, rtol=0)


def test_compiled_scorer_equals_eager_and_compiles_one_graph_for_every_batch_shape(tiny_dir):
    eager = Scorer(tiny_dir, device="cpu")
    compiled = Scorer(tiny_dir, device="cpu", compile=True, max_batch_tokens=256)
    assert compiled.runner.compiled and not compiled.runner.static_shapes
    pairs = PAIRS + make_pairs("short", 40, seed=2)
    np.testing.assert_allclose(compiled.predict(pairs), eager.predict(pairs), atol=1e-5, rtol=0)
    graphs, shapes = compiled.runner.graphs, set(compiled.runner.shapes)
    assert 1 <= graphs <= 2 and len(shapes) >= 3, (graphs, shapes)
    assert all(T % 16 == 0 for T, _, _ in shapes)
    # New pair counts and lengths reuse the graph: the CPU graph's sizes are symbolic.
    more = make_pairs("mixed", 23, seed=3)
    np.testing.assert_allclose(compiled.predict(more), eager.predict(more), atol=1e-5, rtol=0)
    assert compiled.runner.graphs == graphs and len(compiled.runner.shapes) > len(shapes)


def test_compiling_for_cuda_asks_for_cuda_graphs_and_eager_roundings_in_one_set_of_options():
    """Runs anywhere: torch.compile refuses a mode and options together, at the call, before any GPU is touched."""
    from xenc_lab.runner import ModelRunner

    cuda = ModelRunner(torch.nn.Linear(2, 2), torch.device("cuda"), compile=True)
    assert cuda.static_shapes and cuda.compile_options["triton.cudagraphs"] is True
    cpu = ModelRunner(torch.nn.Linear(2, 2), torch.device("cpu"), compile=True)
    assert not cpu.static_shapes and "triton.cudagraphs" not in cpu.compile_options
    from torch._inductor import config as inductor_config

    if hasattr(inductor_config, "emulate_precision_casts"):
        assert cuda.compile_options["emulate_precision_casts"] and cpu.compile_options["emulate_precision_casts"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cuda_scores_equal_crossencoder(tiny_dir, dtype):
    from sentence_transformers import CrossEncoder

    ours = Scorer(tiny_dir, device="cuda", dtype=dtype).predict(PAIRS, activation_fn=torch.nn.Identity())
    exact = CrossEncoder(str(tiny_dir), device="cpu").predict(PAIRS, activation_fn=torch.nn.Identity())
    tol = 1e-4 if dtype == "float32" else 5e-2
    np.testing.assert_allclose(ours, exact, atol=tol, rtol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
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
    from types import SimpleNamespace

    from xenc_lab import layers

    calls = []  # a stand-in kernel with neither argument, as torch's first varlen_attn had it
    monkeypatch.setattr(layers, "_varlen_attn", lambda *args, **kwargs: calls.append(kwargs))
    monkeypatch.setattr(layers, "_VARLEN_TAKES_SCALE", False)
    monkeypatch.setattr(layers, "_VARLEN_TAKES_WINDOW", False)
    half_on_cuda = SimpleNamespace(is_cuda=True, dtype=torch.float16)
    assert layers._use_varlen(half_on_cuda, None, None, 64) and layers._use_varlen(half_on_cuda, None, 64**-0.5, 64)
    assert not layers._use_varlen(half_on_cuda, None, 0.1, 64)  # another scale: the padded SDPA path
    assert not layers._use_varlen(half_on_cuda, 128, None, 64)  # sliding window
    assert not layers._use_varlen(SimpleNamespace(is_cuda=True, dtype=torch.float32), None, None, 64)
    assert not layers._use_varlen(SimpleNamespace(is_cuda=False, dtype=torch.float16), None, None, 64)
    layers._varlen(None, None, None, None, None, 1, 1, 64**-0.5)
    monkeypatch.setattr(layers, "_VARLEN_TAKES_SCALE", True)
    monkeypatch.setattr(layers, "_VARLEN_TAKES_WINDOW", True)
    assert layers._use_varlen(half_on_cuda, 128, 0.1, 64)
    layers._varlen(None, None, None, None, None, 1, 1, 0.1)
    layers._varlen(None, None, None, None, None, 1, 1, None, 128)  # |i - j| <= 64 on either side
    assert calls == [{}, {"scale": 0.1}, {"window_size": (64, 64)}]
