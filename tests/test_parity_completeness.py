"""reports/parity.md is rewritten only by a run of the whole parity suite: the rule, on a small suite of its own."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from parity_tests.completeness import SuiteRun, incomplete

pytest_plugins = ["pytester"]

SUITE = {
    "suite/test_a.py": """
import os, pytest

@pytest.mark.parametrize("arch", ["bert", "gemma"])
def test_one(arch):
    assert os.environ.get("SUITE_FAIL") != arch

@pytest.mark.quick
def test_two():
    pass
""",
    "suite/test_b.py": "def test_three():\n    pass\n",
    "suite/helpers.py": "X = 1\n",  # not a test file: never expected among the collected
    "other/test_c.py": "def test_elsewhere():\n    pass\n",
}


class Verdict:
    """Registers SuiteRun on the small suite as parity_tests/conftest.py does, and keeps its verdict."""

    def __init__(self, root: Path):
        self.root, self.why = root, "not reached"

    def pytest_configure(self, config):
        config.pluginmanager.register(SuiteRun(self.root / "suite", config), "suite-run")

    def pytest_sessionfinish(self, session):
        self.why = session.config.pluginmanager.get_plugin("suite-run").incomplete()


@pytest.fixture
def run(pytester, monkeypatch):
    pytester.makeini("[pytest]\nmarkers =\n    quick: a marker to select by\n")
    for path, text in SUITE.items():
        (pytester.path / path).parent.mkdir(exist_ok=True)
        (pytester.path / path).write_text(text)

    def go(*args, fail=None):
        if fail:
            monkeypatch.setenv("SUITE_FAIL", fail)
        verdict = Verdict(pytester.path)
        pytester.runpytest("-p", "no:cacheprovider", *args, plugins=[verdict])
        return verdict.why

    return go


def test_the_whole_suite_is_whole_even_beside_other_tests_left_out_or_with_a_failure(run):
    assert run("suite") is None
    assert run() is None  # the whole tree
    assert run("-k", "not elsewhere") is None  # a selection that takes out only tests outside the suite
    assert run("suite", "other/test_c.py") is None
    assert run("suite", fail="bert") is None  # a failing test ran: the report says FAIL, it is not partial


@pytest.mark.parametrize(("args", "reason"), [
    (["suite/test_a.py"], "1 of 2 parity test files not collected (test_b.py)"),
    (["suite", "--ignore=suite/test_b.py"], "1 of 2 parity test files not collected"),
    (["suite/test_a.py::test_two", "suite/test_b.py"], "node ids given (suite/test_a.py::test_two)"),
    (["suite", "-k", "not gemma"], "1 of 4 parity tests deselected"),
    (["suite", "-m", "not quick"], "1 of 4 parity tests deselected"),
    (["suite", "--deselect", "suite/test_b.py::test_three"], "1 of 4 parity tests deselected"),
    (["other"], "no parity test selected"),
])
def test_a_partial_run_is_partial(run, args, reason):
    assert run(*args).startswith(reason)


def test_a_run_stopped_early_is_partial(run):
    assert run("suite", "-x", fail="bert") == "3 of 4 selected parity tests did not run"
    assert run("suite", "--maxfail=1", fail="gemma") == "2 of 4 selected parity tests did not run"


def test_the_rule_on_made_up_sessions():
    whole = {"on_disk": {"test_a.py"}, "modules": {"test_a.py"}, "node_args": [], "collected": {"a", "b"},
             "deselected": set(), "selected": {"a", "b"}, "finished": {"a", "b"}}
    assert incomplete(**whole) is None
    assert incomplete(**{**whole, "selected": {"a"}, "finished": {"a"}}) == "1 of 2 parity tests deselected"
    # a plugin that deselects before the collected snapshot is still caught by pytest_deselected
    assert incomplete(**{**whole, "collected": {"a"}, "selected": {"a"}, "finished": {"a"}, "deselected": {"b"}}) \
        == "1 of 2 parity tests deselected"
    assert incomplete(**{**whole, "finished": {"b"}}) == "1 of 2 selected parity tests did not run"
