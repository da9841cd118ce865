"""The peers' own virtual environments: built once from a pinned requirements file under
``$XENC_LAB_CACHE/peers/venv/<name>-<hash of the file>``, so that changing the pins builds a fresh one."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from ...settings import cache_root


def venv_dir(requirements: Path) -> Path:
    """Where the venv for ``requirements`` lives: its name and the first 10 hex digits of the file's sha256."""
    digest = hashlib.sha256(Path(requirements).read_bytes()).hexdigest()[:10]
    return cache_root() / "peers" / "venv" / f"{Path(requirements).stem}-{digest}"


def ensure_venv(requirements: Path, log=print) -> Path:
    """The Python of the venv for ``requirements``, built (python -m venv, pip install -r) if it is not there yet."""
    root = venv_dir(requirements)
    python = root / "bin" / "python"
    done = root / ".complete"
    if done.exists():
        return python
    log(f"building the peer environment {root.name} (once)")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(requirements)], check=True)
    # The registry's torchvision wheel breaks against CPU torch ("operator torchvision::nms does not exist").
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision"], check=False)
    done.write_text(Path(requirements).read_text())
    return python
