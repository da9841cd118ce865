"""Models for the parity suite, built offline and deterministically, cached between runs."""
from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from xenc_lab import Scorer
from xenc_lab.zoo import cache_dir, minilm_cross_encoder
from xenc_lab.zoo.decoders import DECODER_SPECS, build_decoder
from xenc_lab.zoo.encoders import build_model

from .completeness import SuiteRun
from .report import ParityRecorder

# "ci" (the default) is sized for a 2-core CI machine: about 8 minutes of parity properties there, most of it
# sentence-transformers' own forward passes on the real MiniLM-L6 weights, within a CI run of about 25 minutes (150
# examples, the size before, ran the whole suite past it). "thorough" searches further (before a release, or after a
# change to the numerics); "dev" is a quick pass.
settings.register_profile(
    "ci",
    max_examples=110,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("thorough", parent=settings.get_profile("ci"), max_examples=1000)
settings.register_profile("dev", parent=settings.get_profile("ci"), max_examples=25)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Where xenc_lab runs ("cpu", or "cuda" on a machine with a GPU); the oracle runs on the CPU in either case. A run
# on another device reports to reports/parity-<device>.md.
DEVICE = os.environ.get("XENC_LAB_PARITY_DEVICE", "cpu")
REPORT = Path(__file__).resolve().parent.parent / "reports" / ("parity.md" if DEVICE == "cpu" else f"parity-{DEVICE}.md")
ROOT = cache_dir() / "parity"


def _zoo(name: str) -> Path:
    return build_model(name, ROOT)


# name in reports -> builder of the checkpoint directory
MODELS = {
    "minilm-l6 (real weights)": lambda: minilm_cross_encoder(ROOT),
    "bert": lambda: _zoo("bert"),
    "bert-3label": lambda: _zoo("bert-3label"),
    "roberta": lambda: _zoo("roberta"),
    "xlm-roberta": lambda: _zoo("xlm-roberta"),
    "distilbert": lambda: _zoo("distilbert"),
    "electra": lambda: _zoo("electra"),
    "modernbert-cls": lambda: _zoo("modernbert-cls"),
    "modernbert-mean": lambda: _zoo("modernbert-mean"),
    "deberta-v3": lambda: _zoo("deberta-v3"),
    "deberta-v3-3label": lambda: _zoo("deberta-v3-3label"),
}
ARCHS = list(MODELS)


def _decoder(name: str) -> Path:
    return build_decoder(name, ROOT)


# Decoder-LLM rerankers (xenc_lab/zoo/decoders.py), proven by test_decoder_parity.py; name in reports -> builder.
# Not in ARCHS: the encoder properties (token type ids, prepacked per-pair linears, SDPA paths) are not theirs.
DECODERS = {name: functools.partial(_decoder, name) for name in DECODER_SPECS}


@functools.cache
def model_dir(arch: str) -> Path:
    return (MODELS[arch] if arch in MODELS else DECODERS[arch])()


@functools.cache
def scorer(arch: str, **kwargs) -> Scorer:
    return Scorer(model_dir(arch), device=DEVICE, **kwargs)


@functools.cache
def oracle(arch: str, max_length: int | None = None):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(model_dir(arch)), device="cpu", max_length=max_length)


@functools.cache
def exact_oracle(arch: str, max_length: int | None = None):
    """The oracle with its weights and math in float64: exact arithmetic, for telling an ill-conditioned input
    (where sentence-transformers' own fp32 result is off by more than our tolerance) from a real difference."""
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(model_dir(arch)), device="cpu", max_length=max_length, model_kwargs={"dtype": torch.float64})


RECORDER = ParityRecorder()


@pytest.fixture(scope="session")
def recorder() -> ParityRecorder:
    return RECORDER


def pytest_configure(config):
    config.pluginmanager.register(SuiteRun(Path(__file__).parent, config), "parity-suite-run")


def pytest_collection_modifyitems(items):
    # On a GPU the compiled properties are skipped (they are checked on the CPU): a skip keeps the run whole, where a
    # `-k "not compiled"` deselection would leave reports/parity-<device>.md unwritten.
    if DEVICE == "cpu":
        return
    here = Path(__file__).resolve().parent
    for item in items:
        if "compiled" in item.name and here in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.skip(reason=f"the compiled properties run on the CPU, not {DEVICE}"))


def pytest_sessionfinish(session, exitstatus):
    """Only a run of the whole suite rewrites the report: a partial one would replace it with a few rows."""
    if not any(True for _ in RECORDER.rows()):
        return
    if why := session.config.pluginmanager.get_plugin("parity-suite-run").incomplete():
        session.config.get_terminal_writer().line(
            f"\n{REPORT.relative_to(REPORT.parent.parent)} not written: a partial parity run, {why} "
            "(`python -m pytest parity_tests` writes it whole)", yellow=True)
    else:
        RECORDER.write(REPORT, DEVICE)


@pytest.fixture(scope="session", autouse=True)
def _threads():
    # Both engines share the same thread budget; restore whatever the caller had.
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
