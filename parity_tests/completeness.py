"""Whether a pytest session ran the whole parity suite: only such a run may rewrite reports/parity.md.

A single file, node ids, ``-k``/``-m``/``--deselect`` selections, ``--ignore`` and an ``-x``/``--maxfail`` stop all
leave part of the suite out; a report written from them would silently replace the whole one with a few rows."""
from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

import pytest


def incomplete(*, on_disk: set, modules: set, node_args: list, collected: set, deselected: set, selected: set,
               finished: set) -> str | None:
    """Why the session's parity tests are not the whole suite run to the end, or None when they are.

    on_disk: the suite's test files; modules: those collected; node_args: command-line node ids inside the suite;
    collected/deselected/selected/finished: node ids of parity tests before selection, taken out by it, left by it,
    and run to their teardown."""
    if not selected:
        return "no parity test selected"
    if node_args:
        return f"node ids given ({', '.join(node_args)})"
    if missing := on_disk - modules:
        return f"{len(missing)} of {len(on_disk)} parity test files not collected ({', '.join(sorted(missing))})"
    if dropped := (collected - selected) | deselected:
        return f"{len(dropped)} of {len(collected | deselected)} parity tests deselected"
    if unrun := selected - finished:
        return f"{len(unrun)} of {len(selected)} selected parity tests did not run"
    return None


class SuiteRun:
    """A pytest plugin that records which of the suite under ``root`` this session collected, selected and ran."""

    def __init__(self, root: Path, config: pytest.Config):
        self.root = root.resolve()
        self.config = config
        self.modules: set[str] = set()
        self.collected: set[str] = set()
        self.deselected: set[str] = set()
        self.selected: set[str] = set()
        self.finished: set[str] = set()

    def _rel(self, path) -> str | None:
        path = Path(path).resolve()
        return path.relative_to(self.root).as_posix() if path == self.root or self.root in path.parents else None

    def _ours(self, items) -> set[str]:
        return {item.nodeid for item in items if self._rel(item.path) is not None}

    def pytest_collectstart(self, collector):
        if isinstance(collector, pytest.Module) and (rel := self._rel(collector.path)) is not None:
            self.modules.add(rel)

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items):
        self.collected |= self._ours(items)  # before -k/-m/--deselect take any out

    def pytest_deselected(self, items):
        self.deselected |= self._ours(items)

    def pytest_collection_finish(self, session):
        self.selected = self._ours(session.items)

    def pytest_runtest_logreport(self, report):
        if report.when == "teardown" and report.nodeid in self.selected:
            self.finished.add(report.nodeid)

    def on_disk(self) -> set[str]:
        patterns = self.config.getini("python_files")
        return {path.relative_to(self.root).as_posix() for path in self.root.rglob("*.py")
                if "__pycache__" not in path.parts and any(fnmatch(path.name, p) for p in patterns)}

    def node_args(self) -> list[str]:
        here = self.config.invocation_params.dir
        return [arg for arg in self.config.args if "::" in arg and self._rel(here / arg.split("::")[0]) is not None]

    def incomplete(self) -> str | None:
        return incomplete(on_disk=self.on_disk(), modules=self.modules, node_args=self.node_args(),
                          collected=self.collected, deselected=self.deselected, selected=self.selected,
                          finished=self.finished)
