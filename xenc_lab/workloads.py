"""Offline, deterministic (query, passage) workloads for demos and benchmarks.

Texts are word sequences drawn from a fixed English vocabulary, so lengths, not meaning, are what they
model: ``short`` is MS MARCO-like, ``mixed`` has a tail past 512 tokens, ``long`` sits near 512.
"""
from __future__ import annotations

import random

_VOCAB = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no will more can about said "
    "what out up its into them than only other new some could time these two may first then do any like "
    "my now over such our man me even most made after also did many before must through back years where "
    "much your way well down should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three river mountain "
    "protein gene market court election planet ocean algorithm database passage query everest python climate "
    "vaccine theorem museum recipe battery satellite history science energy water city music health "
    "language school system network computer engine island forest bridge century empire physics chemistry "
    "economy university hospital company product research model data result method study analysis process "
    "temperature pressure velocity population species evolution molecule cell tissue orbit galaxy telescope "
    "dynasty treaty parliament constitution republic festival cathedral volcano glacier desert rainfall"
).split()

WORKLOADS = ("short", "mixed", "long")


def _text(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(_VOCAB) for _ in range(n_words)]
    if words:
        words[0] = words[0].capitalize()
    return " ".join(words)


def make_pairs(kind: str = "mixed", n: int = 1000, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (query, passage) pairs of the given kind: 'short', 'mixed' or 'long'."""
    if kind not in WORKLOADS:
        raise ValueError(f"kind must be one of {WORKLOADS}, got {kind!r}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    rng = random.Random(f"{kind}-{seed}")
    pairs = []
    for _ in range(n):
        if kind == "short":
            q, d = rng.randint(5, 15), rng.randint(50, 100)
        elif kind == "long":
            q, d = rng.randint(5, 15), rng.randint(470, 560)
        else:
            q = rng.randint(4, 20)
            u = rng.random()
            d = rng.randint(10, 60) if u < 0.5 else rng.randint(60, 250) if u < 0.85 else rng.randint(250, 600)
        pairs.append((_text(rng, q) + "?", _text(rng, d) + "."))
    return pairs
