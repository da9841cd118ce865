"""The model's math, as both engines' work is counted, and the GEMM rate it is shown against (the ceiling)."""
from __future__ import annotations

import time

import numpy as np
import torch

from ..cpu.prepacked import PrepackedLinear
from ..models.deberta_v2 import pos_att_type


def encoder_dims(config) -> tuple[int, int, int]:
    """(layers, hidden, intermediate) of an encoder config, whatever the family calls them."""
    layers = getattr(config, "num_hidden_layers", None) or config.n_layers
    hidden = getattr(config, "hidden_size", None) or config.dim
    inter = getattr(config, "intermediate_size", None) or config.hidden_dim
    return layers, hidden, inter


def attention_heads(config) -> tuple[int, int]:
    """(heads, head dim) of an encoder config whose attention runs in ``ops.attention``."""
    _, d, _ = encoder_dims(config)
    heads = getattr(config, "num_attention_heads", None) or config.n_heads
    return heads, d // heads


def projection_shapes(config) -> list[tuple[int, int]]:
    """(in, out) of each layer's projections: fused QKV, attention output, the feed-forward's two (ModernBERT's
    first one is GeGLU's, twice as wide)."""
    _, d, f = encoder_dims(config)
    up = 2 * f if getattr(config, "model_type", "") == "modernbert" else f
    return [(d, 3 * d), (d, d), (d, up), (f, d)]


def _relative_span(config) -> tuple[int, int]:
    """DeBERTa-v2's disentangled attention: (relative positions each token's c2p/p2c scores span, how many of the
    two terms the config turns on); (0, 0) elsewhere."""
    if getattr(config, "model_type", "") != "deberta-v2" or not getattr(config, "relative_attention", False):
        return 0, 0
    buckets, max_relative = getattr(config, "position_buckets", -1), getattr(config, "max_relative_positions", -1)
    span = buckets if buckets > 0 else max_relative if max_relative > 0 else config.max_position_embeddings
    return 2 * span, len(pos_att_type(config) & {"c2p", "p2c"})


def model_gflop(config, lengths: np.ndarray) -> float:
    """The full model's math in GFLOP, as both engines' work is counted: 2 x non-embedding matmul weights x tokens
    (ELECTRA's embedding projection included), attention's 4 x layers x d x n^2, and DeBERTa-v2's c2p/p2c scores,
    2 x layers x d x (2 x span) per token each. DeBERTa's projection of its relative embeddings, done once a batch
    (so per pair depending on batching: 2.3% of a 32-pair batch of 100-token pairs at v3-base size), is left out."""
    layers, d, _ = encoder_dims(config)
    weights = layers * sum(k * n for k, n in projection_shapes(config))
    embedding = getattr(config, "embedding_size", None)
    if getattr(config, "model_type", "") == "electra" and embedding and embedding != d:
        weights += embedding * d
    positions, terms = _relative_span(config)
    per_token = 2 * weights + terms * 2 * layers * d * positions
    lengths = lengths.astype(np.float64)
    return (per_token * lengths.sum() + 4 * layers * d * (lengths**2).sum()) / 1e9


def gemm_rate(
    config,
    dtype: torch.dtype,
    tokens: int | None = None,
    repeats: int = 10,
    bf16_gemm: str | None = None,
    device: str | torch.device = "cpu",
) -> float:
    """GFLOP/s of the fastest GEMM at the model's projection shapes (``projection_shapes``). On the
    CPU: oneDNN with prepacked weights where available, else torch's default; in bfloat16 that is the path
    xenc_lab takes (``cpu.gemm.bf16_gemm``) unless ``bf16_gemm`` says which. On CUDA: torch's
    GEMM (cuBLAS) at torch's precision settings. ``tokens`` rows: 4,096 on the CPU (a batch's worth), 65,536 on
    CUDA, where a 4,096-row GEMM of a small model is over before the GPU fills."""
    device = torch.device(device)
    tokens = tokens or (4096 if device.type == "cpu" else 65536)
    shapes = projection_shapes(config)
    x = {k: torch.randn(tokens, k, dtype=dtype, device=device) for k in {k for k, _ in shapes}}
    linears = {}
    for k, n in shapes:
        linear = torch.nn.Linear(k, n, bias=False).to(device=device, dtype=dtype).requires_grad_(False)
        fast = PrepackedLinear.supported(dtype, device)
        linears[k, n] = PrepackedLinear(linear, bf16_gemm) if fast else linear
    flop = sum(2 * tokens * k * n for k, n in shapes)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    with torch.inference_mode():
        for k, n in shapes:  # warm up: oneDNN builds each shape's kernel on its first call (cuBLAS its handle)
            linears[k, n](x[k])
        sync()
        for _ in range(repeats):
            start = time.perf_counter()
            for k, n in shapes:
                linears[k, n](x[k])
            sync()
            best = min(best, time.perf_counter() - start)
    return flop / best / 1e9
