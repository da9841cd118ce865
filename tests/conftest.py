"""Session fixtures: tiny random BERT cross-encoders (1 and 3 labels), our Scorer and the CrossEncoder oracle on each.

The models are xenc_lab.zoo.encoders' ``bert-minilm-tokenizer`` specs (``build_tiny``): 2 layers, 32 wide, 64 positions,
MiniLM-L6's tokenizer, seed 0."""
from __future__ import annotations

import os

# Every test runs offline: nothing here may reach the model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from xenc_lab.zoo.encoders import build_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny1"), num_labels=1)


@pytest.fixture(scope="session")
def tiny3_dir(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny3"), num_labels=3)


@pytest.fixture(scope="session")
def scorer(tiny_dir):
    from xenc_lab import Scorer

    return Scorer(tiny_dir, device="cpu")


@pytest.fixture(scope="session")
def scorer3(tiny3_dir):
    from xenc_lab import Scorer

    return Scorer(tiny3_dir, device="cpu")


@pytest.fixture(scope="session")
def oracle(tiny_dir):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(tiny_dir), device="cpu")


@pytest.fixture(scope="session")
def oracle3(tiny3_dir):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(tiny3_dir), device="cpu")


PAIRS = [
    ("how tall is everest", "Everest is 8,849 m high."),
    ("q", "d"),
    ("hello world", ""),
    ("a query about rivers", "the river flows " * 40),  # truncated at max_length=64
    ("a very long query about mountains " * 12, "and a long document about rivers " * 8),  # both sides cut
    ("", "an empty query"),
    ("  padded query  ", "\tnothing is stripped\n"),
    ("café naïve", "日本語のテキスト 🙂 and ünïcödé"),
    ("python", "Python is a programming language used for data science and machine learning."),
]


@pytest.fixture
def pairs():
    return list(PAIRS)
