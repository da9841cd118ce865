"""The XENC_LAB_* table and the choices made at load: every variable the package reads is declared once and documented,
none is read while scoring, and a loaded Scorer keeps its choices whatever the environment does next."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from xenc_lab import Scorer, settings

PACKAGE = Path(settings.__file__).parent
TABLE = PACKAGE.parent / "docs" / "architecture.md"  # its "Environment variables" section


def test_every_variable_the_package_names_is_declared_in_the_table_and_the_docs():
    named = set()
    for source in PACKAGE.rglob("*.py"):
        named |= set(re.findall(r"XENC_LAB_[A-Z0-9_]+", source.read_text()))
    assert named and named <= set(settings.SETTINGS), sorted(named - set(settings.SETTINGS))
    readme = TABLE.read_text()
    assert all(f"| `{name}` |" in readme for name in settings.SETTINGS), [
        name for name in settings.SETTINGS if f"| `{name}` |" not in readme
    ]


def test_only_the_table_reads_the_environment():
    """Models, ops, the runner and the engine read no environment variable: their choices come at load."""
    reads = re.compile(r"environ\.get\(name|environ\b.*XENC_LAB|getenv\(")
    readers = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if reads.search(p.read_text())]
    assert readers == ["settings.py"], readers
    scoring = [*(PACKAGE / "models").glob("*.py"), *(PACKAGE / "ops").glob("*.py"), PACKAGE / "runner.py",
               PACKAGE / "engine.py", PACKAGE / "batch.py"]
    assert not [p.name for p in scoring if "settings" in p.read_text()]


def test_a_value_outside_the_choices_is_refused_naming_them_and_case_does_not_matter(monkeypatch):
    monkeypatch.setenv("XENC_LAB_CPU_BATCH_SHAPES", " Exact ")
    assert settings.get("XENC_LAB_CPU_BATCH_SHAPES") == "exact"
    monkeypatch.setenv("XENC_LAB_CPU_BATCH_SHAPES", "sometimes")
    with pytest.raises(ValueError, match="XENC_LAB_CPU_BATCH_SHAPES must be one of bucketed, exact, got 'sometimes'"):
        settings.get("XENC_LAB_CPU_BATCH_SHAPES")
    monkeypatch.setenv("XENC_LAB_CPU_BATCH_SHAPES", "")
    assert settings.get("XENC_LAB_CPU_BATCH_SHAPES") is None


@pytest.mark.slow
def test_a_loaded_scorer_keeps_its_choices_whatever_the_environment_says_later(tiny_dir, pairs, monkeypatch):
    monkeypatch.setenv("XENC_LAB_CPU_ATTENTION", "sdpa")
    monkeypatch.setenv("XENC_LAB_FIRST_TOKEN_KV", "projected")
    scorer = Scorer(tiny_dir, device="cpu")
    choices = scorer.choices
    assert (choices.attention, choices.first_token_kv) == ("sdpa", "projected")
    assert scorer.runner.pads_pairs  # planned for pairs laid out padded
    with pytest.raises(dataclasses.FrozenInstanceError):
        choices.attention = "kernel"
    before = scorer.predict(pairs, activation_fn=torch.nn.Identity())
    monkeypatch.setenv("XENC_LAB_CPU_ATTENTION", "kernel")
    monkeypatch.setenv("XENC_LAB_FIRST_TOKEN_KV", "folded")
    np.testing.assert_array_equal(scorer.predict(pairs, activation_fn=torch.nn.Identity()), before)
    assert scorer.choices is choices and scorer.runner.choices is choices


def test_a_bad_value_is_refused_before_any_weights_are_read(tiny_dir, monkeypatch):
    monkeypatch.setenv("XENC_LAB_BF16_GEMM", "int4")
    monkeypatch.setattr("xenc_lab.scorer.load_model", lambda *a, **k: pytest.fail("the weights were read"))
    with pytest.raises(ValueError, match="XENC_LAB_BF16_GEMM must be one of native, fp32, fp16, got 'int4'"):
        Scorer(tiny_dir, device="cpu")
