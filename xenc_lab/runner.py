"""Stage 4: run the packed model on one batch, with the choices made at load. torch.compile is applied here, and only
here."""
from __future__ import annotations

import time

import numpy as np
import torch

from .batch import StreamBatch
from .choices import Choices
from .models import PackedModel
from .pages import ATTENTION_SLACK, bucket_shape, bucket_tokens, plan_batches


def _graphs_compiled() -> int:
    """Graphs torch.compile has built in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class ModelRunner:
    """Runs the model on packed batches, compiled or not, handing it the load's ``Choices`` with every batch.

    Batch shapes (``choices.batch_shapes``, the (T, B, L) that ``batch_shape`` gives a batch):
    - ``"bucketed"``, the CPU's: tokens up to a multiple of an eighth of the budget, sequences up to a power of two,
      the attention length the batch's own (a decoder's chunks: the stream length alone, ``chunk_tokens``). oneDNN keeps what it builds for each GEMM shape it meets, so a shape per
      batch made memory grow with the input (docs/cpu-backends.md).
    - ``"graphs"``, compile=True on CUDA: a CUDA graph per shape, which must be static, so the attention length is
      bucketed too: a long run records a handful of graphs.
    - ``"exact"``: each batch its own shape (whole pages).

    Compiled with symbolic sizes (``choices.dynamic``), one graph serves every batch on the CPU (the GEMMs and
    attention are opaque ops; inductor fuses what lies between them), and one compilation every bucket on CUDA."""

    MAX_GRAPHS = 64  # compiled graphs kept before torch.compile would fall back to eager

    def __init__(self, model: PackedModel, choices: Choices):
        self.model = model
        self.choices = choices
        self.device = next(model.parameters()).device
        self.compiled = choices.compile
        self.batch_shapes = choices.batch_shapes
        # Where some layer lays pairs out padded, batches are bounded so that the padding stays small.
        self.pads_pairs = model.pads_pairs(choices)
        self.compile_options = self._compile_options() if choices.compile else {}
        self._forward = (
            torch.compile(model, dynamic=choices.dynamic, options=self.compile_options) if choices.compile else model
        )
        self.shapes: set[tuple[int, int, int]] = set()  # (T, B, L) of every batch run so far
        self.graphs = 0  # graphs compiled for this model
        self.compile_seconds = 0.0  # time of the calls that compiled one

    def plan(self, lengths: np.ndarray, page_size: int, max_pages: int, max_pairs: int | None = None) -> list[np.ndarray]:
        """``pages.plan_batches`` for this model: batches bounded by ``ATTENTION_SLACK`` where it pads pairs, else
        filled to the budget."""
        slack = ATTENTION_SLACK if self.pads_pairs else None
        return plan_batches(lengths, page_size, max_pages, max_pairs, slack)

    def batch_shape(self, lengths: np.ndarray, page_size: int, max_pages: int) -> tuple[int, int, int] | None:
        """The (T, B, L) to pad a batch of pairs of these token ``lengths`` to, or None: its own shape."""
        if self.batch_shapes == "exact":
            return None
        return bucket_shape(int(lengths.sum()), len(lengths), int(lengths.max()), page_size, max_pages,
                            bucket_length=self.batch_shapes == "graphs")

    def chunk_tokens(self, tokens: int, page_size: int, max_pages: int) -> int | None:
        """The stream length to pad a decoder's batch of ``tokens`` real tokens to, or None: its own."""
        return bucket_tokens(tokens, page_size, max_pages) if self.batch_shapes == "bucketed" else None

    def _compile_options(self) -> dict:
        """Inductor's options: on CUDA those of mode "reduce-overhead" (CUDA graphs; torch.compile takes a mode or
        options, not both). Everywhere, inductor keeps the roundings to bf16/fp16 that eager code does
        (emulate_precision_casts): by default it drops a round trip through a 16-bit type inside a fused kernel,
        and compile=True would change the numbers."""
        import torch._inductor
        from torch._inductor import config as inductor_config

        graphs = self.batch_shapes == "graphs"
        options = dict(torch._inductor.list_mode_options("reduce-overhead")) if graphs else {}
        if hasattr(inductor_config, "emulate_precision_casts"):
            options["emulate_precision_casts"] = True
        return options

    @torch.inference_mode()
    def __call__(self, batch: StreamBatch, *state) -> torch.Tensor:
        """(P, num_labels) logits for the batch's pairs, in the batch's order (shape filler dropped). ``state``: what
        else the model's forward takes (a decoder's KV cache)."""
        self.shapes.add(batch.shape())
        batch = batch.to(self.device)
        if not self.compiled:
            return self.model(batch, self.choices, *state)[: len(batch.pairs)]
        before, start = _graphs_compiled(), time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=self.MAX_GRAPHS):
            logits = self._forward(batch, self.choices, *state)
        if (after := _graphs_compiled()) > before:
            self.graphs += after - before
            self.compile_seconds += time.perf_counter() - start
        return logits[: len(batch.pairs)]
