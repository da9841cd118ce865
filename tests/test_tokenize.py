"""Pairs truncated and laid out by xenc_lab give the tokenizer's own ids (parity_tests checks every architecture's
tokenizer against sentence-transformers; these check the pieces, and both truncation sides)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from tokenizers.processors import TemplateProcessing

from xenc_lab.loader import load_config
from xenc_lab.st_format import read_cross_encoder_save
from xenc_lab.tokenize import PairTokenizer, longest_first, read_layout

WORDS = ["w", "the", "river", "flows", "ünïcödé", "日本語", "🙂", "a-b", "1,234", "naïve", "unaffable", "xyzzyq"]


def word_level(max_length: int | None = None) -> Tokenizer:
    """One token per whitespace-separated word, no special tokens: lengths are word counts."""
    tok = Tokenizer(WordLevel({"w": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    if max_length is not None:
        tok.enable_truncation(max_length, strategy="longest_first")
    return tok


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 40), st.integers(0, 40), st.integers(0, 50))
def test_longest_first_keeps_what_the_tokenizers_library_keeps(n1, n2, budget):
    encoding = word_level(budget).encode(" ".join(["w"] * n1), " ".join(["w"] * n2))
    kept = np.bincount(np.array(encoding.sequence_ids, dtype=np.int64), minlength=2).tolist()
    assert list(longest_first(n1, n2, budget)) == kept


def test_longest_first_by_hand():
    assert longest_first(3, 4, 10) == (3, 4)  # fits: nothing cut
    assert longest_first(2, 30, 10) == (2, 8)  # the shorter keeps all, the longer takes the rest
    assert longest_first(30, 2, 10) == (8, 2)
    assert longest_first(6, 30, 11) == (5, 6)  # both cut: halves, the odd token to the longer
    assert longest_first(30, 6, 11) == (6, 5)
    assert longest_first(20, 20, 11) == (5, 6)  # a tie: the odd token to the second
    assert longest_first(5, 5, 0) == (0, 0)


@pytest.fixture(scope="module")
def pair_tokenizer(tiny_dir):
    return lambda max_length=None: PairTokenizer(tiny_dir, load_config(tiny_dir), max_length, save=read_cross_encoder_save(tiny_dir))


texts = st.lists(st.sampled_from(WORDS), max_size=90).map(" ".join) | st.text(max_size=40)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(pairs=st.lists(st.tuples(texts, texts), min_size=1, max_size=6), max_length=st.sampled_from([3, 4, 9, 16, 64]),
       side=st.sampled_from(["right", "left"]))
def test_pairs_get_the_tokenizers_own_ids_and_type_ids(pair_tokenizer, pairs, max_length, side):
    tok = pair_tokenizer(max_length)
    assert tok.layout is not None
    tok.tokenizer.truncation_side = side
    text_1, text_2 = [a for a, _ in pairs], [b for _, b in pairs]
    ours = tok(text_1, text_2)
    theirs = tok._tokenizer_call(text_1, text_2, max_length)
    assert ours.offsets.tolist() == theirs.offsets.tolist()
    assert ours.ids.tolist() == theirs.ids.tolist()
    assert ours.type_ids.tolist() == theirs.type_ids.tolist()
    assert ours.lengths.max() <= max_length
    # a max_length for one call (predict's max_length=) cuts as a tokenizer built with it
    wide = pair_tokenizer()
    wide.tokenizer.truncation_side = side
    per_call = wide(text_1, text_2, max_length)
    assert per_call.ids.tolist() == ours.ids.tolist() and per_call.offsets.tolist() == ours.offsets.tolist()
    assert per_call.type_ids.tolist() == ours.type_ids.tolist()


def test_the_layout_is_read_from_the_post_processor(pair_tokenizer):
    tok = pair_tokenizer()
    cls, sep = tok.tokenizer.cls_token_id, tok.tokenizer.sep_token_id
    assert tok.layout.parts == [("special", cls, 0), ("text", 0, 0), ("special", sep, 0), ("text", 1, 1), ("special", sep, 1)]


def test_a_layout_with_the_texts_swapped_is_not_read(tiny_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_dir)
    backend = Tokenizer.from_str(hf.backend_tokenizer.to_str())
    backend.no_padding()
    assert read_layout(backend) is not None
    backend.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $B [SEP] $A:1 [SEP]:1",
        special_tokens=[("[CLS]", hf.cls_token_id), ("[SEP]", hf.sep_token_id)],
    )
    assert read_layout(backend) is None


def test_without_a_layout_the_tokenizer_truncates_pairs_itself(tiny_dir, monkeypatch):
    monkeypatch.setattr("xenc_lab.tokenize.read_layout", lambda backend: None)
    tok = PairTokenizer(tiny_dir, load_config(tiny_dir), 12, save=read_cross_encoder_save(tiny_dir))
    assert tok.layout is None
    first, second = "the river flows " * 6, "second text"
    out = tok.tokenizer(first, second, truncation="longest_first")
    enc = tok([first], [second])
    assert enc.pair(0) == out["input_ids"] and enc.type_ids.tolist() == out["token_type_ids"] and len(enc.pair(0)) == 12


def test_a_backend_that_does_not_serialize_truncates_pairs_itself(tiny_dir, monkeypatch):
    class Unserializable:  # as tokenizers answers for a pre-tokenizer written in Python
        @staticmethod
        def from_str(text):
            raise Exception("Custom PreTokenizer cannot be serialized")  # noqa: TRY002 (its very type)

    monkeypatch.setattr("xenc_lab.tokenize.Tokenizer", Unserializable)
    tok = PairTokenizer(tiny_dir, load_config(tiny_dir), 12, save=read_cross_encoder_save(tiny_dir))
    assert tok.layout is None and tok.backend is None
    enc = tok(["the river flows " * 6], ["second text"])
    assert enc.pair(0) == tok.tokenizer("the river flows " * 6, "second text", truncation="longest_first")["input_ids"]
