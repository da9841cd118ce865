"""The one configuration object of a Scorer (what to load and how to batch it), and the checks of its arguments.

Three records, three words: ``config`` (``ScorerConfig``, here) is what the caller asked for; ``settings`` is what
the environment forces (``XENC_LAB_*``); ``choices`` (``choices.Choices``) is what the engine decided from both, the
device and the model, once at load."""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What a pair whose text_2 overflows max_length is scored by: its truncated tokens, or the max, mean or first of its
# windows' scores (docs/sentence-transformers.md#long-documents).
LONG_DOCUMENTS = ("truncate", "max", "mean", "first")
# What the linear layers are quantized to (vLLM's ``quantization``): None, or "int8" (CPU only, docs/int8.md).
QUANTIZATIONS = ("int8",)
QUANTIZATION_HELP = ("int8: the linear layers in int8 on the CPU, the rest at --dtype; scores move within "
                     "docs/int8.md's measured bounds (default: none)")


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
    long_documents: str = "truncate"  # or "max", "mean", "first": text_2 scored in windows, the scores aggregated
    window_stride: int | None = None  # tokens between windows' starts; None: half a window
    quantization: str | None = None  # "int8": linear layers int8 (CPU), the rest at dtype

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
        self.long_documents = long_documents_mode(self.long_documents)
        self.window_stride = stride_of(self.window_stride)
        self.quantization = quantization_of(self.quantization, self.device)

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


def long_documents_mode(mode) -> str:
    """``mode`` checked against ``LONG_DOCUMENTS``: TypeError for a value that is not a str, ValueError for another."""
    if not isinstance(mode, str):
        raise TypeError(f"long_documents must be one of {', '.join(map(repr, LONG_DOCUMENTS))}, got {mode!r} "
                        f"({type(mode).__name__})")
    if mode not in LONG_DOCUMENTS:
        raise ValueError(f"long_documents must be one of {', '.join(map(repr, LONG_DOCUMENTS))}, got {mode!r}")
    return mode


def quantization_of(quantization, device: str) -> str | None:
    """None, or "int8" on the CPU: int8 linear layers run on the CPU's int8 dot products; no CUDA route exists."""
    if quantization is None:
        return None
    if not isinstance(quantization, str):
        raise TypeError(f"quantization must be None or one of {', '.join(map(repr, QUANTIZATIONS))}, got "
                        f"{quantization!r} ({type(quantization).__name__})")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {', '.join(map(repr, QUANTIZATIONS))}, got {quantization!r}")
    if not str(device).startswith("cpu"):
        raise ValueError(f"quantization={quantization!r} runs on the CPU only (device='cpu'), got device={device!r}; "
                         "on a GPU use dtype='bfloat16' or 'float16'")
    return quantization


def stride_of(stride) -> int | None:
    """A window stride in tokens (an int >= 1), or None for half a window."""
    return None if stride is None else whole_number("window_stride", stride, optional=True)


def resolve_device(device) -> torch.device:
    """A device xenc_lab runs on: the CPU, or a CUDA GPU that torch can see (None: CUDA where torch sees a GPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
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


def check_call_device(own: torch.device, device) -> None:
    """CrossEncoder.predict's ``device``: here only the Scorer's own, ``own`` (None, or the same device)."""
    if device is None:
        return
    if isinstance(device, (list, tuple)):
        raise TypeError(f"device must be one device, the Scorer's ({own}): xenc_lab does not spread a call "
                        f"over several; got {device!r}")
    wanted = resolve_device(device)
    index = lambda d: d.index if d.index is not None or d.type != "cuda" else torch.cuda.current_device()
    if (wanted.type, index(wanted)) != (own.type, index(own)):
        raise ValueError(f"device={str(device)!r}: this Scorer runs on {own}; build a Scorer with "
                         f"device={str(device)!r} to score there")


def share_prefix_of(share_prefix, decoder: bool, architecture: str) -> bool:
    """None: on for decoders (off for encoders, whose tokens all attend to each other: no prefix is computed once);
    False: off (for measurement); True on an encoder is refused."""
    if share_prefix is not None and not isinstance(share_prefix, bool):
        raise TypeError(f"share_prefix must be True, False or None, got {share_prefix!r}")
    if share_prefix and not decoder:
        raise ValueError(
            f"share_prefix=True needs a decoder reranker (causal attention: a shared prefix is computed once); "
            f"{architecture} is an encoder, whose every token attends to every other. Leave share_prefix unset (None)"
        )
    return decoder if share_prefix is None else share_prefix


def check_max_length(config: ScorerConfig, max_length: int, specials: int, limit: int | None, architecture: str,
                     chunked: bool, remedy: str, source: str = "") -> None:
    """Refuse a max_length below a pair's special tokens (the tokenizer could not truncate to it), one the position
    table cannot embed (sentence-transformers would fail on the first pair that long) or one pair of which the
    token budget cannot hold (``chunked``: a decoder runs a long pair in chunks). ``remedy``: "pass" (to the Scorer)
    or "use" (per call), and ``source`` (" (from ...)") for the message."""
    if max_length < specials:
        raise ValueError(f"max_length={max_length}{source} cannot hold the {specials} special tokens of a pair; "
                         f"{remedy} max_length>={specials}")
    if limit is not None and max_length > limit:
        raise ValueError(f"max_length={max_length}{source} exceeds what {architecture} can embed ({limit} positions); "
                         f"{remedy} max_length<={limit}")
    longest = -(-max_length // config.page_size) * config.page_size  # whole pages
    if longest > config.max_batch_tokens and not chunked:
        raise ValueError(
            f"max_batch_tokens={config.max_batch_tokens} cannot hold one pair of max_length={max_length}{source} "
            f"({longest} tokens in pages of {config.page_size}); raise max_batch_tokens or lower max_length"
        )
