"""Stage 1: (text_1, text_2) pairs -> token ids, exactly as sentence-transformers' CrossEncoder makes them.

CrossEncoder.predict calls the tokenizer on the pairs with ``truncation="longest_first"`` and no explicit
``max_length``, so the tokenizer's ``model_max_length`` decides: the value the user passed, else a
CrossEncoder save's ``max_seq_length``, else the tokenizer's own capped at ``config.max_position_embeddings``.
Nothing is stripped.

Pairs are encoded text by text and truncated here, by the tokenizers library's own ``longest_first`` rule, then
laid out with the special tokens where the tokenizer's post-processor puts them. The ids are the tokenizer's (the
library encodes the two texts of a pair independently too), but the cost is linear: the library, asked to truncate a
pair, also builds every combination of the two texts' overflowing pieces, which the caller then drops
(docs/architecture.md has the measurement).
Tokenizers whose layout is not a fixed template around the two texts (checked on probe pairs at load), and slow
tokenizers, are called as CrossEncoder calls them.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tokenizers.normalizers import Lowercase
from tokenizers.normalizers import Sequence as NormalizerSequence
from transformers import AutoTokenizer, PretrainedConfig

from .st_format import CrossEncoderSave

logger = logging.getLogger(__name__)


def first_rows(owner: np.ndarray) -> np.ndarray:
    """(N,) bool: which of N rows, a pair's rows adjacent (``owner``: the pair of each), are their pair's first."""
    return np.concatenate([[True], owner[1:] != owner[:-1]]) if len(owner) else np.ones(0, dtype=bool)


@dataclass(slots=True)
class Encodings:
    """Token ids of N rows, flat: row i is ``ids[offsets[i]:offsets[i + 1]]``. A row is a pair, or one window of a
    pair's text_2 where ``owner`` says which pair each row scores (a pair's rows adjacent, its first window first)."""

    ids: np.ndarray  # (total_tokens,) int64
    type_ids: np.ndarray | None  # (total_tokens,) int64, only where the tokenizer emits them
    offsets: np.ndarray  # (N + 1,) int64
    owner: np.ndarray | None = None  # (N,) int64, the pair of each row; None: row i is pair i

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def pair(self, i: int) -> list[int]:
        return self.ids[self.offsets[i] : self.offsets[i + 1]].tolist()

    def first_rows(self) -> np.ndarray:
        """(N,) bool: which rows are their pair's first window (every row without windows)."""
        return np.ones(len(self), dtype=bool) if self.owner is None else first_rows(self.owner)

    def last_rows(self) -> np.ndarray:
        """(N,) bool: which rows are their pair's last window (every row without windows), for counting pairs done."""
        if self.owner is None or not len(self):
            return np.ones(len(self), dtype=bool)
        return np.concatenate([self.owner[1:] != self.owner[:-1], [True]])

    def take(self, rows: np.ndarray) -> Encodings:
        """These rows alone, in this order, with their owners."""
        lengths = self.lengths[rows]
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        index = np.repeat(self.offsets[rows] - offsets[:-1], lengths) + np.arange(offsets[-1])
        return Encodings(self.ids[index], None if self.type_ids is None else self.type_ids[index], offsets,
                         None if self.owner is None else self.owner[rows])

    @classmethod
    def from_rows(cls, rows: list[list[int]], type_rows: list[list[int]] | None = None) -> Encodings:
        """Pairs' ids given row by row (and their type ids, if any), laid flat."""
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows)), out=offsets[1:])
        flat = lambda rs: np.fromiter((t for r in rs for t in r), dtype=np.int64, count=int(offsets[-1]))
        return cls(flat(rows), None if type_rows is None else flat(type_rows), offsets)


def backend_copy(tokenizer) -> Tokenizer | None:
    """A copy of a fast tokenizer's backend free of the truncation and padding transformers sets on its own, or None
    (a slow tokenizer, or one whose Python components do not serialize)."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    try:
        backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    except Exception:  # noqa: BLE001 (tokenizers raises plain Exception: Python components do not serialize)
        return None
    backend.no_truncation()
    backend.no_padding()
    return backend


def longest_first(n1: int, n2: int, budget: int) -> tuple[int, int]:
    """How many tokens of each text a pair keeps when its two texts may hold ``budget`` tokens together (max_length
    less the pair's special tokens): the tokenizers library's ``longest_first`` rule (``truncate_encodings``). The
    shorter text keeps what it has while that is at most half the budget and the longer one takes the rest; past
    that each gets half, and an odd budget's extra token goes to the longer text (to the second one on a tie)."""
    if budget == 0:
        return 0, 0
    if n1 + n2 <= budget:
        return n1, n2
    short = min(n1, n2)
    keep_long = short if short > budget else max(short, budget - short)
    if short + keep_long > budget:
        short, keep_long = budget // 2, budget // 2 + budget % 2
    return (keep_long, short) if n1 > n2 else (short, keep_long)


class PairLayout:
    """Where a tokenizer's post-processor puts a pair's special tokens: ``parts`` holds ("special", id, type id)
    for each special token and ("text", 0 or 1, type id) for each text, in order (the first text first)."""

    def __init__(self, parts: list[tuple[str, int, int]]):
        self.parts = parts
        self.text_parts = [i for i, part in enumerate(parts) if part[0] == "text"]
        assert [parts[i][1] for i in self.text_parts] == [0, 1], parts
        first, second = self.text_parts
        ids = [part[1] for part in parts]
        self.before, self.between, self.after = ids[:first], ids[first + 1 : second], ids[second + 1 :]
        self.specials = len(parts) - 2
        self.part_types = np.array([part[2] for part in parts], dtype=np.int64)

    def ids(self, ids_1: list[int], ids_2: list[int]) -> list[int]:
        return self.before + ids_1 + self.between + ids_2 + self.after

    def type_ids(self, kept: np.ndarray) -> np.ndarray:
        """The type ids of pairs laid end to end whose texts kept (N, 2) tokens: one run per part."""
        runs = np.ones((len(kept), len(self.parts)), dtype=np.int64)
        runs[:, self.text_parts] = kept
        return np.repeat(np.tile(self.part_types, len(kept)), runs.ravel())


_PROBES = [("hello world", "a b c"), ("a", "b"), ("", "some text"), ("one two three four five", ""), ("", ""),
           ("Zürich 東京 ok", "🙂 x")]


def read_layout(backend: Tokenizer) -> PairLayout | None:
    """The pair layout ``backend``'s post-processor makes (``backend`` with no truncation or padding), or None where it
    is not a fixed template of special tokens around the two texts' own tokens, as encoded alone (probe pairs)."""
    full = backend.encode(*_PROBES[0], add_special_tokens=True)
    parts: list[tuple[str, int, int]] = []
    for token, type_id, seq in zip(full.ids, full.type_ids, full.sequence_ids):
        if seq is None:
            parts.append(("special", token, type_id))
        elif not parts or parts[-1][:2] != ("text", seq):
            parts.append(("text", seq, type_id))
        elif parts[-1][2] != type_id:
            return None
    if [part[1] for part in parts if part[0] == "text"] != [0, 1]:
        return None
    layout = PairLayout(parts)
    for a, b in _PROBES:
        full = backend.encode(a, b, add_special_tokens=True)
        ids_1, ids_2 = (e.ids for e in backend.encode_batch([a, b], add_special_tokens=False))
        if layout.ids(ids_1, ids_2) != full.ids or layout.type_ids(np.array([[len(ids_1), len(ids_2)]])).tolist() != full.type_ids:
            return None
    return layout


def load_tokenizer(
    path: Path,
    config: PretrainedConfig,
    max_length: int | None = None,
    trust_remote_code: bool = False,
    save: CrossEncoderSave | None = None,
    position_limit: int | None = None,
):
    """The tokenizer as CrossEncoder loads it, and the max_length its pairs are cut at with where that came from (None:
    passed). From ``path`` with a CrossEncoder save's tokenizer arguments, its model_max_length the one passed, else the
    save's (its tokenizer arguments', then its max_seq_length), else the tokenizer's own capped at the position table.
    A save's ``processing_kwargs`` max_length, which CrossEncoder calls the tokenizer with, truncates every pair unless
    ``max_length`` is passed. ``position_limit``: the longest pair the model can embed (``loader.position_limit``), None
    where positions are unbounded."""
    save = save if save is not None else CrossEncoderSave()
    kwargs = dict(save.tokenizer_kwargs)
    source = f"{save.module_config}'s processor_kwargs" if "model_max_length" in kwargs else None
    if save.max_seq_length is not None and "model_max_length" not in kwargs:
        kwargs["model_max_length"], source = save.max_seq_length, f"{save.module_config}'s max_seq_length"
    if max_length is not None:
        kwargs["model_max_length"], source = max_length, None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001 (a missing, empty or corrupt file raises anything, JSON errors up)
        if isinstance(err, ImportError) or "trust_remote_code" in str(err):
            raise
        raise ValueError(f"could not load the tokenizer from {path} ({type(err).__name__}: {err}): its files are "
                         "missing, empty or corrupt; copy the tokenizer's files into the model folder") from err
    check_vocabulary(tokenizer, path)
    if "model_max_length" not in kwargs:
        source = "the tokenizer's model_max_length"
        max_positions = getattr(config, "max_position_embeddings", -1)
        if max_positions is not None and max_positions != -1:
            tokenizer.model_max_length = min(tokenizer.model_max_length, max_positions)
        limit = position_limit
        if limit is not None and tokenizer.model_max_length > limit:
            logger.warning("%s: the tokenizer allows %d tokens but the position table embeds %d: pairs are cut at "
                           "%d (sentence-transformers fails on longer ones)", path, tokenizer.model_max_length,
                           limit, limit)
            tokenizer.model_max_length = limit
    if save.do_lower_case:
        force_lowercase(tokenizer)
    cut = int(tokenizer.model_max_length)
    if save.text_max_length is not None and max_length is None:
        cut, source = save.text_max_length, f"{save.module_config}'s processing_kwargs"
    return tokenizer, cut, source


def check_vocabulary(tokenizer, path) -> None:
    """Refuse a tokenizer whose vocabulary is its special tokens alone: what transformers builds from a folder without
    tokenizer files, which turns every text into [UNK] (sentence-transformers scores on with it)."""
    specials = set(tokenizer.all_special_tokens)
    if len(tokenizer) <= len(specials) + 1:
        raise ValueError(
            f"the tokenizer loaded from {path} has {len(tokenizer)} tokens, all special ({sorted(specials)}): its "
            "files (tokenizer.json, or vocab.txt / vocab.json and merges.txt / a sentencepiece .model) are missing or "
            "empty, and every text would become the unknown token. Copy the tokenizer's files into the model folder"
        )


def force_lowercase(tokenizer) -> None:
    """Put a Lowercase first in the fast tokenizer's normalizer, as sentence-transformers does for do_lower_case."""
    backend = tokenizer.backend_tokenizer
    normalizer = backend.normalizer
    parts = list(normalizer) if isinstance(normalizer, NormalizerSequence) else [normalizer]
    if not any(isinstance(n, Lowercase) for n in parts):
        backend.normalizer = NormalizerSequence([Lowercase()] + [n for n in parts if n is not None])


class PairTokenizer:
    def __init__(
        self,
        path: Path,
        config: PretrainedConfig,
        max_length: int | None = None,
        trust_remote_code: bool = False,
        save: CrossEncoderSave | None = None,
        position_limit: int | None = None,
        *,
        loaded: tuple | None = None,
    ):
        """The tokenizer as CrossEncoder loads it (``load_tokenizer``; ``loaded``: its result, where the caller has
        it), and the pair layout its post-processor makes."""
        if loaded is None:
            loaded = load_tokenizer(path, config, max_length, trust_remote_code, save, position_limit)
        self.tokenizer, self.max_length, source = loaded
        self.max_length_source = source  # where a max_length not passed came from (None: passed), for messages
        specials = self.tokenizer.num_special_tokens_to_add(pair=True)  # a max_length below is refused by the Scorer
        self.emits_token_type_ids = "token_type_ids" in self.tokenizer.model_input_names
        self.specials = specials
        self.backend = backend_copy(self.tokenizer)
        self.layout = None if self.backend is None else read_layout(self.backend)  # None: the tokenizer truncates
        if self.layout is not None and self.layout.specials != specials:
            self.layout = None

    def from_where(self) -> str:
        """Where a max_length not passed came from, as ' (from ...)' for messages; '' where it was passed."""
        return f" (from {self.max_length_source})" if self.max_length_source else ""

    def __call__(self, text_1: list[str], text_2: list[str], max_length: int | None = None) -> Encodings:
        """The pairs' ids, truncated to ``max_length`` tokens (default: the tokenizer's, ``self.max_length``)."""
        assert len(text_1) == len(text_2), (len(text_1), len(text_2))
        max_length = self.max_length if max_length is None else max_length
        assert max_length >= self.specials, (max_length, self.specials)
        layout = self.layout
        if layout is None:
            return self._tokenizer_call(text_1, text_2, max_length)
        budget = max_length - self.specials
        from_left = self.tokenizer.truncation_side == "left"
        n = len(text_1)
        rows, kept = [], np.empty((n, 2), dtype=np.int64)
        firsts = self.backend.encode_batch(text_1, add_special_tokens=False)
        seconds = self.backend.encode_batch(text_2, add_special_tokens=False)
        for i, (first, second) in enumerate(zip(firsts, seconds)):
            ids_1, ids_2 = first.ids, second.ids
            keep_1, keep_2 = longest_first(len(ids_1), len(ids_2), budget)
            if from_left:
                ids_1, ids_2 = ids_1[len(ids_1) - keep_1 :], ids_2[len(ids_2) - keep_2 :]
            elif keep_1 < len(ids_1) or keep_2 < len(ids_2):
                ids_1, ids_2 = ids_1[:keep_1], ids_2[:keep_2]
            rows.append(layout.ids(ids_1, ids_2))
            kept[i] = keep_1, keep_2
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(kept.sum(axis=1) + self.specials, out=offsets[1:])
        ids = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(offsets[-1]))
        return Encodings(ids, layout.type_ids(kept) if self.emits_token_type_ids else None, offsets)

    def _tokenizer_call(self, text_1: list[str], text_2: list[str], max_length: int) -> Encodings:
        """The pairs as CrossEncoder tokenizes them: the tokenizer truncates them itself."""
        out = self.tokenizer(
            text_1,
            text_2,
            truncation="longest_first",
            max_length=max_length,
            padding=False,
            return_attention_mask=False,
            return_token_type_ids=None,
        )
        return Encodings.from_rows(out["input_ids"], out.get("token_type_ids"))
