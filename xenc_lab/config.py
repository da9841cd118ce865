"""The one configuration object of a Scorer: what to load and how to batch it; and the environment variables
that override choices xenc_lab makes from the machine (``XENC_LAB_BF16_GEMM``, ``XENC_LAB_CPU_ATTENTION``)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class ScorerConfig:
    model: str
    device: str = "cpu"
    dtype: str = "float32"
    max_length: int | None = None  # None: tokenizer's model_max_length capped at the position table
    page_size: int = 16  # tokens per page; batch shapes are whole pages
    max_batch_tokens: int = 4096  # the page budget of one batch, in tokens
    compile: bool = False
    trust_remote_code: bool = False

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("page_size", "max_batch_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_batch_tokens % self.page_size:
            raise ValueError(
                f"max_batch_tokens must be a whole number of pages of {self.page_size} tokens, "
                f"got {self.max_batch_tokens}"
            )
        if self.max_length is not None and (
            not isinstance(self.max_length, int) or isinstance(self.max_length, bool) or self.max_length < 2
        ):
            raise ValueError(f"max_length must be an int >= 2 or None, got {self.max_length!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def pages_per_batch(self) -> int:
        return self.max_batch_tokens // self.page_size


def env_choice(variable: str, choices: tuple[str, ...]) -> str | None:
    """The choice an environment variable forces (one of ``choices``, any case), or None where it is unset."""
    forced = os.environ.get(variable, "").strip().lower()
    if forced and forced not in choices:
        raise ValueError(f"{variable} must be one of {', '.join(choices)}, got {forced!r}")
    return forced or None
