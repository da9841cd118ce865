"""One engine shape: every family declares one of the two model contracts, the Scorer builds the family's engine
once at load, and no architecture name is read outside ``models/`` and the loader (the test-model builders of
``zoo/`` excepted: they write checkpoints of named architectures)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from xenc_lab import Scorer
from xenc_lab.engine import INPUT_BLOCK, EncoderEngine
from xenc_lab.models import ARCHITECTURES, DecoderModel, EncoderModel
from xenc_lab.zoo.decoders import build_decoder

PACKAGE = Path(__file__).resolve().parent.parent / "xenc_lab"
# Where architecture names belong: the family registry and its classes, the loader, the test-model builders.
NAMES_ALLOWED = ("models/", "loader.py", "zoo/")
ARCHITECTURE_NAME = re.compile(r"^([A-Z]\w*)?For(CausalLM|SequenceClassification)$")


def _strings(path: Path) -> list[str]:
    """The string constants of a module's code, docstrings left out."""
    tree = ast.parse(path.read_text(encoding="utf8"))
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs]


def test_every_family_declares_exactly_one_of_the_two_contracts():
    for name, family in ARCHITECTURES.items():
        assert issubclass(family, EncoderModel) != issubclass(family, DecoderModel), name
        assert family.causal is issubclass(family, DecoderModel), name


def test_no_architecture_name_is_read_outside_the_models_and_the_loader():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(NAMES_ALLOWED):
            continue
        found += [f"{rel}: {s!r}" for s in _strings(path) if ARCHITECTURE_NAME.match(s) or s in ARCHITECTURES]
    assert not found, found
    assert ARCHITECTURE_NAME.match("GemmaForCausalLM") and ARCHITECTURE_NAME.match("ForCausalLM")  # the check bites


def test_the_scorer_builds_its_familys_engine_once_at_load(scorer, tmp_path_factory):
    assert isinstance(scorer.engine, EncoderEngine) and scorer.kv_cache is None and scorer.share_prefix is False
    assert scorer.engine.budget.num_labels == scorer.num_labels == 1 and INPUT_BLOCK == 1024
    decoder = Scorer(build_decoder("gemma-reranker", tmp_path_factory.mktemp("gemma")), device="cpu")
    engine = decoder.engine
    assert type(engine).__name__ == "DecoderEngine" and decoder.share_prefix and decoder.num_labels == 1
    layers, kv_heads, head_dim = decoder.model.cache_shape()
    assert decoder.kv_cache is engine.cache and decoder.kv_cache.shape == (layers, kv_heads, head_dim) == (2, 1, 32)
    decoder.predict([("q", "a"), ("q", "b")])
    assert decoder.engine is engine and decoder.token_counts is engine.counts and engine.counts.total > 0


@pytest.mark.parametrize("name", ["gemma-reranker", "gemma-yes-no"])
def test_a_gemma_reranker_reads_the_score_its_save_names(name, tmp_path_factory):
    """bge-reranker-v2-gemma's save: the "Yes" logit alone (LogitScore false_token_id None); without a save,
    sentence-transformers' default yes/no."""
    path = build_decoder(name, tmp_path_factory.mktemp(name))
    scorer = Scorer(path, device="cpu")
    tokenizer = scorer.tokenizer.tokenizer
    want = ((tokenizer.convert_tokens_to_ids("Yes"), None) if name == "gemma-reranker"
            else (tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")))
    assert scorer.model.score_tokens == want
    assert scorer.model.score_rows.shape[0] == (1 if want[1] is None else 2)
