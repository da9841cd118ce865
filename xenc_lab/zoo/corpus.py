"""What every tiny checkpoint of the zoo shares: a deterministic multilingual corpus to train tokenizers on, an
atomic build cache, and the spread check (raw scores that vary across pairs, so parity is not vacuous)."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random
import shutil
import tempfile

# ---------------------------------------------------------------------------------------------
# Built-in multilingual corpus (deterministic)
# ---------------------------------------------------------------------------------------------
_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on the street while people walk by.",
    "How many people live in Berlin? Around 3.7 million people live in Berlin.",
    "The weather is lovely today, it's so sunny outside!",
    "He drove to the stadium to watch the football match with his friends.",
    "Machine learning models are trained on large datasets of text and images.",
    "What is the capital of France? Paris is the capital and largest city of France.",
    "Children are playing in the park near the old river bridge.",
    "The committee postponed its decision until next Thursday afternoon.",
    "Cross-encoders score a query and a passage jointly, which is slow but accurate.",
    "I can't believe it's already 2024; time flies when you're having fun.",
    "Prices rose by 12.5% in March, according to the statistics office.",
    "Le café est très bon, mais la crème brûlée était déjà froide.",
    "Où est la bibliothèque? Elle est à côté de l'hôpital.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein, sagte der Müller.",
    "Die Straße ist naß und die Bäume sind grün.",
    "El niño comió una manzana en la mañana; ¿quién pagó la cuenta?",
    "São Paulo é a maior cidade do Brasil, com milhões de habitantes.",
    "Tiếng Việt có nhiều dấu thanh như sắc, huyền, hỏi, ngã, nặng.",
    "Zażółć gęślą jaźń; Čeština, Ærøskøbing, Œuvre, façade, naïve, coöperate.",
    "Combining marks: cafe\u0301, nai\u0308ve, n\u0303, a\u0300 la carte, e\u0301le\u0300ve.",
    "Москва — столица России, а Киев — столица Украины.",
    "Η Αθήνα είναι η πρωτεύουσα της Ελλάδας.",
    "我喜欢在周末读书和喝茶。北京是中国的首都。",
    "机器学习模型需要大量的数据来训练。今天天气很好。",
    "東京は日本の首都です。私は寿司が大好きです。",
    "ひらがなとカタカナを勉強しています。",
    "서울은 대한민국의 수도입니다. 저는 한국어를 배우고 있어요.",
    "اللغة العربية جميلة جدا، والقاهرة مدينة كبيرة.",
    "עברית היא שפה עתיקה, וירושלים היא עיר עתיקה.",
    "हिंदी भारत की एक प्रमुख भाषा है।",
    "ภาษาไทยเป็นภาษาที่สวยงาม",
    "I love pizza 🍕 and coffee ☕! 😀😂🎉 👍🏽 👨‍👩‍👧‍👦 🇫🇷",
    "Emoji only: 🚀🔥💯✨🙏",
    "Code: def f(x): return x ** 2  # squares <html> & </html> [brackets] {braces}",
    "Email me at someone@example.com or visit https://example.org/path?q=1&r=2.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 -42 1e-5 ½ ² ³",
    "Tabs\tand\nnewlines   and   multiple    spaces should be handled.",
    "UPPER CASE Mixed Case lower case ÀÉÎÕÜ àéîõü ÇÑ",
    "Symbols: © ® ™ € £ ¥ § ¶ † ‡ • … ‰ ‹ › « » “quoted” ‘single’ — – -",
]


_SYLLABLES = {  # pseudo-word material per script, so the trainers see many distinct words
    "latin": "ba be bi bo bu ca ce co da de di do fa fe fi ga go ha he ka ke ki la le li lo lu ma me "
             "mi mo na ne ni no pa pe pi po ra re ri ro sa se si so ta te ti to va ve vi za ze "
             "tion ing ment ness able ous ver pre con str th sh ch é è à ü ö ñ ç ø å ß",
    "cyrillic": "ка ко ла ли ма ми на но ра ро та ти ва во жу щи ся ть ый ая",
    "greek": "κα λη μέ ρα το πο νι σα θε ξι",
}
_RANGES = [(0x4E00, 160), (0xAC00, 80), (0x3041, 40), (0x30A1, 40), (0x0627, 30), (0x05D0, 27),
           (0x0905, 30)]  # CJK, Hangul, Hiragana, Katakana, Arabic, Hebrew, Devanagari


def _pseudo_word(rng: random.Random) -> str:
    pick = rng.random()
    if pick < 0.6:
        sylls = _SYLLABLES["latin" if pick < 0.45 else rng.choice(["cyrillic", "greek"])].split()
        w = "".join(rng.choice(sylls) for _ in range(rng.randint(1, 4)))
        return w.capitalize() if rng.random() < 0.2 else w
    start, n = rng.choice(_RANGES)
    return "".join(chr(start + rng.randrange(n)) for _ in range(rng.randint(1, 3)))


def corpus() -> list[str]:
    """Base sentences, plus deterministic word salads mixing real words and pseudo-words."""
    words = [w for s in _SENTENCES for w in s.split()]
    rng = random.Random(1234)
    salads = [" ".join(rng.choice(words) if rng.random() < 0.5 else _pseudo_word(rng)
                       for _ in range(rng.randint(4, 16))) for _ in range(3000)]
    return _SENTENCES * 5 + salads




def cached_build(root: pathlib.Path, name: str, seed: int, overrides: dict, build) -> pathlib.Path:
    """The directory ``root / name-s<seed>[-<hash of overrides>]``, made by ``build(tmp_dir)`` once: built in a
    temporary folder, then renamed into place (atomic), so a half-written build is never seen and concurrent
    builders of the same model both end with it."""
    root = pathlib.Path(root)
    dirname = f"{name}-s{seed}"
    if overrides:
        blob = json.dumps(overrides, sort_keys=True, default=str).encode()
        dirname += "-" + hashlib.sha1(blob).hexdigest()[:10]
    final = root / dirname
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{dirname}.tmp-", dir=root))
    tmp.chmod(0o755)
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # a concurrent builder may have won the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final



# ---------------------------------------------------------------------------------------------
# Non-vacuity check
# ---------------------------------------------------------------------------------------------
_LONG = " ".join(_SENTENCES[:12])
SPREAD_PAIRS: list[tuple[str, str]] = [
    (_SENTENCES[i], _SENTENCES[j]) for i, j in
    [(0, 1), (2, 2), (3, 4), (5, 9), (6, 2), (7, 8), (10, 11), (12, 13), (14, 15), (16, 17),
     (18, 19), (20, 12), (21, 22), (23, 24), (25, 26), (27, 28), (29, 30), (31, 32), (33, 34),
     (35, 36), (37, 38), (39, 0), (1, 23), (28, 5), (4, 3)]
] + [
    ("", ""), ("", "A passage without a query."), ("A query without a passage.", ""),
    ("short", "text"), ("dog", "The quick brown fox jumps over the lazy dog."),
    ("what is the capital of france", "Paris is the capital of France."),
    ("what is the capital of france", "Berlin is the capital of Germany."),
    ("😀", "🍕☕"), ("北京", "东京"), ("café", "cafe\u0301"), ("ABC", "abc"),
    ("long query " + _LONG, "short passage"), ("short query", _LONG + " " + _LONG),
    (_LONG, _LONG[::-1]), ("   ", "\t\n"), ("a " * 200, "b " * 200),
    ("Numbers 1 2 3", "Numbers 3 2 1"), ("yes", "no"), ("no", "yes"), ("?", "!"),
    ("مرحبا", "שלום"), ("Привет", "Hello"), ("İstanbul", "istanbul"), ("ß", "SS"),
    ("The Louvre is a museum.", "The Louvre is in Paris."),
]


def spread_check(path) -> dict:
    """Raw-logit statistics (Identity activation) of CrossEncoder over SPREAD_PAIRS."""
    import numpy as np
    import torch
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(path), device="cpu", activation_fn=torch.nn.Identity())
    logits = np.asarray(model.predict(SPREAD_PAIRS, batch_size=16, convert_to_numpy=True),
                        dtype=np.float64).reshape(len(SPREAD_PAIRS), -1)
    return {"n": len(SPREAD_PAIRS),
            "std": float(logits.std(axis=0).min()),  # across pairs; worst label if num_labels > 1
            "min": float(logits.min()), "max": float(logits.max()),
            "finite": bool(np.isfinite(logits).all()),
            # |logit| > 15 would make sigmoid saturate to ~0/1 in float32
            "saturated_frac": float((np.abs(logits) > 15).mean())}
