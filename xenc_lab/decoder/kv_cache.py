"""The paged KV cache of decoders: fixed-size pages of keys and values per layer, allocated and freed on the host as
plain integers with reference counts (a page shared by several sequences' page tables is freed when the last of them
lets it go), as nano-vllm's block manager does."""
from __future__ import annotations

from collections import deque

import numpy as np
import torch


class PageAllocator:
    """Pages 0..n-1 with reference counts; ``allocate`` hands out free pages with one reference each."""

    def __init__(self, pages: int = 0):
        self.refs = np.zeros(pages, dtype=np.int64)
        self.free: deque[int] = deque(range(pages))

    @property
    def pages(self) -> int:
        return len(self.refs)

    @property
    def used(self) -> int:
        return self.pages - len(self.free)

    def grow(self, pages: int) -> None:
        """Add pages up to ``pages`` in all."""
        if pages > self.pages:
            self.free.extend(range(self.pages, pages))
            self.refs = np.concatenate([self.refs, np.zeros(pages - self.pages, dtype=np.int64)])

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise MemoryError(f"{n} pages asked for, {len(self.free)} free of {self.pages}")
        pages = [self.free.popleft() for _ in range(n)]
        self.refs[pages] = 1
        return pages

    def reset(self) -> None:
        """Every page free again: after a run that was interrupted before it let its pages go."""
        self.refs[:] = 0
        self.free = deque(range(self.pages))

    def share(self, pages: list[int]) -> None:
        """One more page table holds ``pages``."""
        assert (self.refs[pages] > 0).all(), pages
        np.add.at(self.refs, pages, 1)

    def release(self, pages: list[int]) -> None:
        """A page table lets ``pages`` go; those no table holds any more are free again."""
        np.subtract.at(self.refs, pages, 1)
        assert (self.refs[pages] >= 0).all(), pages
        self.free.extend(p for p in dict.fromkeys(pages) if self.refs[p] == 0)


class KVCache:
    """Keys and values of every layer, ``k`` and ``v`` of shape (layers, pages * page_size, kv_heads, head_dim): slot
    ``page * page_size + i`` holds the i-th token of a page. The tensors grow (and keep their contents) when more
    pages are needed than they hold."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.shape = (layers, kv_heads, head_dim)
        self.page_size, self.dtype, self.device = page_size, dtype, device
        self.allocator = PageAllocator()
        self.k = self.v = torch.empty(layers, 0, kv_heads, head_dim, dtype=dtype, device=device)

    @classmethod
    def for_config(cls, config, page_size: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        """An empty cache for a decoder of this transformers ``config``."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, page_size, dtype, device)

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    def reserve(self, pages: int) -> None:
        """Make sure ``pages`` more pages can be allocated, growing the tensors (at least doubling) if needed."""
        short = pages - len(self.allocator.free)
        if short <= 0:
            return
        total = max(self.allocator.pages + short, 2 * self.allocator.pages)
        layers, kv_heads, head_dim = self.shape
        grown = []
        for old in (self.k, self.v):
            new = torch.empty(layers, total * self.page_size, kv_heads, head_dim, dtype=self.dtype, device=self.device)
            new[:, : old.shape[1]] = old
            grown.append(new)
        self.k, self.v = grown
        self.allocator.grow(total)

    def slots_of(self, pages: list[int], length: int) -> np.ndarray:
        """The first ``length`` slots of ``pages`` laid end to end."""
        page = np.asarray(pages, dtype=np.int64)
        slots = (page[:, None] * self.page_size + np.arange(self.page_size, dtype=np.int64)[None, :]).reshape(-1)
        assert length <= len(slots), (length, len(slots))
        return slots[:length]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
