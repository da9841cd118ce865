"""The package's layers, read from its imports (every import statement, those inside functions too).

The contract (``LAYERS``) is data, written once here and printed by ``python tests/test_layers.py``; docs/architecture.md
shows it. A layer is a subpackage of xenc_lab; each says what it may import from the package (``only``) or what it may
never import (``never``, matched against every dotted part of the imported module's name).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "xenc_lab"

# What stands above the shared ops: the models, the drivers, the pipeline's front (tokenizers), the facade and tooling.
ABOVE_OPS = ("models", "engine", "engines", "decoder_engine", "runner", "loader", "tokenize", "chat", "scorer", "ir",
             "serve", "bench", "distributed", "cli", "report", "table", "zoo", "st_args", "st_format")
LAYERS = {
    "cpu": {"only": ("xenc_lab.cpu", "xenc_lab.settings"),
            "why": "the CPU backend: kernels and their build, under the pipeline and the models"},
    "ops": {"never": ABOVE_OPS, "why": "what models share: under the models and everything that drives them"},
}
TEST_PACKAGES = ("tests", "parity_tests")  # the package imports neither, nor puts anything on sys.path


def contract() -> str:
    lines = ["layers (xenc_lab/):"]
    for layer, rule in LAYERS.items():
        what = (f"imports only {', '.join(rule['only'])}" if "only" in rule
                else f"imports nothing of {', '.join(rule['never'])}")
        lines.append(f"  {layer}/ {what} ({rule['why']})")
    lines.append(f"  the package imports nothing from {' or '.join(p + '/' for p in TEST_PACKAGES)} and never changes "
                 "sys.path")
    return "\n".join(lines)


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path) -> list[str]:
    """Every module ``path`` imports, as absolute dotted names (``from a import b`` gives a.b where b is a module of
    the package, else a)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf8"))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            modules = [f"{base}.{a.name}" for a in node.names if is_module(f"{base}.{a.name}", root)]
            found += modules or [base]  # the names are modules, or things defined in ``base``
    return found


def is_module(dotted: str, root: Path) -> bool:
    path = root.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def changes_sys_path(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf8"))):
        if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) and \
                node.value.id == "sys":
            return True
    return False


def breaches(root: Path = PACKAGE) -> list[str]:
    """Every import under ``root`` (the package's directory) that breaks ``LAYERS`` or reaches a test package."""
    out = []
    for path in sorted(root.rglob("*.py")):
        name, rel = module_name(path, root), path.relative_to(root.parent)
        layer = name.split(".")[1] if name.count(".") else ""
        rule = LAYERS.get(layer)
        for target in imports(path, root):
            top, parts = target.split(".")[0], target.split(".")
            if top in TEST_PACKAGES:
                out.append(f"{rel} imports {target} (a test package)")
            if top != root.name or rule is None:
                continue
            if "only" in rule and not any(target == m or target.startswith(m + ".") for m in rule["only"]):
                out.append(f"{rel} ({layer}/) imports {target}")
            if "never" in rule and any(p in rule["never"] for p in parts[1:]):
                out.append(f"{rel} ({layer}/) imports {target}, which stands above it")
        if changes_sys_path(path):
            out.append(f"{rel} reads or changes sys.path")
    return out


def test_the_package_keeps_its_layers():
    found = breaches()
    assert found == [], "\n".join(["layer breaches:", *found, "", contract()])


def write_package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "xenc_lab" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "xenc_lab"


@pytest.mark.parametrize("rel, text, expected", [
    ("cpu/kernels.py", "from ..batch import pack\n", "xenc_lab/cpu/kernels.py (cpu/) imports xenc_lab.batch"),
    ("cpu/kernels.py", "def f():\n    from xenc_lab.models import bert\n",
     "xenc_lab/cpu/kernels.py (cpu/) imports xenc_lab.models"),
    ("ops/attention.py", "from .. import scorer\n", "xenc_lab/ops/attention.py (ops/) imports xenc_lab.scorer, which "
                                                    "stands above it"),
    ("ops/attention.py", "from ..models.bert import Bert\n", "xenc_lab/ops/attention.py (ops/) imports xenc_lab.models"),
    ("report.py", "def f():\n    from parity_tests.zoo import build\n", "xenc_lab/report.py imports parity_tests.zoo "
                                                                        "(a test package)"),
    ("report.py", "import sys\nsys.path.insert(0, 'x')\n", "xenc_lab/report.py reads or changes sys.path"),
])
def test_a_breach_is_found_and_named(tmp_path, rel, text, expected):
    root = write_package(tmp_path, {"__init__.py": "", "cpu/__init__.py": "", "ops/__init__.py": "",
                                    "settings.py": "", "scorer.py": "", rel: text})
    assert expected in "\n".join(breaches(root))


def test_what_the_layers_allow_is_not_a_breach(tmp_path):
    root = write_package(tmp_path, {
        "__init__.py": "from .scorer import Scorer\n",
        "cpu/__init__.py": "", "cpu/kernels.py": "from . import native\nfrom .. import settings\nimport torch\n",
        "ops/__init__.py": "", "ops/attention.py": "from ..batch import PackedBatch\nfrom ..cpu.kernels import f\n",
        "settings.py": "import os\n", "scorer.py": "from .ops.attention import g\n"})
    assert breaches(root) == []


if __name__ == "__main__":
    print(contract())
    sys.exit(1 if breaches() else 0)
