"""Stage 1: (text_1, text_2) pairs -> token ids, exactly as sentence-transformers' CrossEncoder makes them.

CrossEncoder.predict calls the tokenizer on the pairs with ``truncation="longest_first"`` and no explicit
``max_length``, so the tokenizer's ``model_max_length`` decides: the value the user passed, else a
CrossEncoder save's ``max_seq_length``, else the tokenizer's own capped at ``config.max_position_embeddings``.
Nothing is stripped.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers.normalizers import Lowercase
from tokenizers.normalizers import Sequence as NormalizerSequence
from transformers import AutoTokenizer, PretrainedConfig

from .st_format import CrossEncoderSave


@dataclass(slots=True)
class Encodings:
    """Token ids of N pairs, flat: pair i is ``ids[offsets[i]:offsets[i + 1]]``."""

    ids: np.ndarray  # (total_tokens,) int64
    type_ids: np.ndarray | None  # (total_tokens,) int64, only where the tokenizer emits them
    offsets: np.ndarray  # (N + 1,) int64

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def pair(self, i: int) -> list[int]:
        return self.ids[self.offsets[i] : self.offsets[i + 1]].tolist()


class PairTokenizer:
    def __init__(
        self,
        path: Path,
        config: PretrainedConfig,
        max_length: int | None = None,
        trust_remote_code: bool = False,
        save: CrossEncoderSave = CrossEncoderSave(),
    ):
        if max_length is None:
            max_length = save.max_seq_length
        kwargs = {} if max_length is None else {"model_max_length": max_length}
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
        max_positions = getattr(config, "max_position_embeddings", -1)
        if max_length is None and max_positions is not None and max_positions != -1:
            self.tokenizer.model_max_length = min(self.tokenizer.model_max_length, max_positions)
        if save.do_lower_case:
            self._force_lowercase()
        self.max_length = int(self.tokenizer.model_max_length)
        specials = self.tokenizer.num_special_tokens_to_add(pair=True)
        if self.max_length < specials:  # the tokenizer would not truncate at all, and pairs would run long
            raise ValueError(
                f"max_length={self.max_length} cannot hold the {specials} special tokens of a pair; "
                f"pass max_length>={specials}"
            )
        self.emits_token_type_ids = "token_type_ids" in self.tokenizer.model_input_names

    def _force_lowercase(self) -> None:
        backend = self.tokenizer.backend_tokenizer
        normalizer = backend.normalizer
        parts = list(normalizer) if isinstance(normalizer, NormalizerSequence) else [normalizer]
        if not any(isinstance(n, Lowercase) for n in parts):
            backend.normalizer = NormalizerSequence([Lowercase()] + [n for n in parts if n is not None])

    def __call__(self, text_1: list[str], text_2: list[str]) -> Encodings:
        assert len(text_1) == len(text_2), (len(text_1), len(text_2))
        out = self.tokenizer(
            text_1,
            text_2,
            truncation="longest_first",
            padding=False,
            return_attention_mask=False,
            return_token_type_ids=None,
        )
        rows = out["input_ids"]
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.fromiter((t for r in rows for t in r), dtype=np.int64, count=int(offsets[-1]))
        type_ids = None
        if "token_type_ids" in out:
            rows = out["token_type_ids"]
            type_ids = np.fromiter((t for r in rows for t in r), dtype=np.int64, count=int(offsets[-1]))
        return Encodings(ids, type_ids, offsets)
