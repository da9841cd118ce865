"""hypothesis strategies for the texts researchers actually throw at a reranker, and the ones that break tokenizers."""
from __future__ import annotations

import random

from hypothesis import strategies as st

WORDS = (
    "the of and to in is was for on that with as by at from his an were are which this be or had not but "
    "what all when we there can been has more if no out do so up said about than into them only could new "
    "time some these two may first then other like over such our its people also years most after state "
    "river mountain protein gene market court election planet ocean algorithm database reranker passage query "
    "everest python language climate vaccine theorem museum recipe battery satellite"
).split()

ODD = [
    "",
    " ",
    "   \t\n ",
    "\u00a0\u2009\u3000",  # no-break, thin and ideographic spaces
    "café naïve résumé Ångström",
    "e\u0301 a\u0300 o\u0308 n\u0303",  # combining marks
    "Z\u0351\u036b\u0343a\u0310\u0327l\u036a\u0314g\u0309o",  # stacked combining marks
    "日本語のテキストと漢字",
    "中文搜索引擎重排序",
    "한국어 문장입니다",
    "مرحبا بالعالم، كيف حالك؟",
    "שלום עולם",
    "\u202eevil right-to-left override\u202c",
    "👩\u200d👩\u200d👧\u200d👦 family",
    "🏳\ufe0f\u200d🌈 flag 👍🏽 thumbs",
    "\x00\x01\x07\x1b[31mred\x1b[0m\x7f",
    "[SEP]",
    "[CLS] [SEP] [PAD] [MASK] [UNK]",
    "</s>",
    "<s> </s> <pad> <mask> <unk>",
    "<|endoftext|> <|im_start|>",
    "▁metaspace ▁look▁alike",
    "Ġbyte Ċlevel",
    "##wordpiece ##suffix",
    "http://example.com/a.png",
    "C:\\\\path\\\\to\\\\file.jpg",
    "1,234.56 3.14e-10 0x1F",
]

word = st.sampled_from(WORDS)
piece = st.one_of(
    word,
    st.sampled_from(ODD),
    st.text(min_size=1, max_size=12),  # arbitrary unicode, control characters included
)
short_text = st.lists(piece, max_size=12).map(" ".join)


def _long_text(rng: random.Random) -> str:
    """60 to 700 words of WORDS, most under 200 (60 + 640 u^5 words, u uniform in [0, 1)), picked by a seed. Two
    draws from hypothesis, not one per word: drawing the words one by one took most of a tiny model's parity
    example. Hypothesis still shrinks them (toward shorter texts and other seeds)."""
    length = 60 + round(640 * rng.random() ** 5)
    return " ".join(random.Random(rng.getrandbits(32)).choices(WORDS, k=length))


# Past the position limit of the tiny models, and at times alone past MiniLM's 512 tokens.
long_text = st.randoms(use_true_random=False).map(_long_text)
text = st.one_of(short_text, short_text, long_text, st.sampled_from(ODD))
pair = st.tuples(text, text)
pairs = st.lists(pair, min_size=1, max_size=6)

# A mixed bag for batch-composition properties: short and long pairs together.
mixed_pairs = st.lists(st.tuples(st.one_of(short_text, long_text), st.one_of(short_text, long_text)), min_size=2, max_size=12)

# Decoder rerankers' control tokens, template pieces and verdict words, which a text carries into a chat template's
# render (transformers tokenizes a control token written in a text as the control token) or ends with (a seq-cls head
# reads the last token that is not the pad token, <|endoftext|> in the zoo's decoder tokenizers).
DECODER_ODD = [
    "<|endoftext|>",
    "x <|endoftext|><|endoftext|>",
    "<|im_end|>\n<|im_start|>assistant\n",
    "<think>\n\n</think>\n\n",
    "<|begin_of_text|>",
    "yes", "no", " yes", "\nyes",
    "<Document>: ", "Query: q\nDocument: d\nRelevant:",
]
decoder_text = st.one_of(
    text,
    text,
    st.sampled_from(DECODER_ODD),
    st.lists(st.one_of(word, st.sampled_from(DECODER_ODD)), max_size=8).map(" ".join),
)
decoder_pairs = st.lists(st.tuples(decoder_text, decoder_text), min_size=1, max_size=6)

# A reranker's workloads: one query with several documents (1:N), and several queries each with their documents (N:N).
# Queries repeat across pairs, so a decoder shares their prefixes; a document may repeat too, and any text may be long
# (a long query truncated leaves its pairs the same ids).
query_documents = st.tuples(decoder_text, st.lists(decoder_text, min_size=2, max_size=8))
queries_documents = st.lists(st.tuples(decoder_text, st.lists(decoder_text, min_size=1, max_size=5)), min_size=2,
                             max_size=4)
