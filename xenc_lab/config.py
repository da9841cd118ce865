"""The one configuration object of a Scorer (what to load and how to batch it), and the checks of its arguments."""
from __future__ import annotations

import numbers
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
        self.page_size = whole_number("page_size", self.page_size)
        self.max_batch_tokens = whole_number("max_batch_tokens", self.max_batch_tokens)
        for name in ("compile", "trust_remote_code"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.max_batch_tokens % self.page_size:
            raise ValueError(
                f"max_batch_tokens must be a whole number of pages of {self.page_size} tokens, "
                f"got {self.max_batch_tokens}"
            )
        if self.max_length is not None:
            self.max_length = whole_number("max_length", self.max_length, minimum=2, optional=True)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def pages_per_batch(self) -> int:
        return self.max_batch_tokens // self.page_size


def whole_number(name: str, value, minimum: int = 1, optional: bool = False) -> int:
    """``value`` as a Python int of at least ``minimum``: any integer type (NumPy's too), never a bool."""
    expected = f"an int >= {minimum}" + (" or None" if optional else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return int(value)


def resolve_device(device) -> torch.device:
    """A device xenc_lab runs on: the CPU, or a CUDA GPU that torch can see."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str such as 'cpu' or 'cuda:0', or a torch.device, got {type(device).__name__}")
    try:
        resolved = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from err
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"xenc_lab runs on 'cpu' or 'cuda', got device {str(resolved)!r}")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(resolved)!r} was asked for, but torch sees no CUDA GPU here")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(resolved)!r}: torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    return resolved
