"""Fixtures shared by tests/ and parity_tests/, and the markers given by directory (pyproject.toml registers them)."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
# The parity suite's searches and the notebooks take minutes each: the edit-test lane (pytest -m "not slow") leaves
# them out, bar the arbitration rule's own tests on made-up numbers.
SLOW_DIRECTORIES = ("parity_tests", "notebooks")
FAST_FILES = ("parity_tests/test_arbitration.py",)


def pytest_collection_modifyitems(config, items):
    """parity_tests/ is the parity suite (``parity``: `xenc-lab report parity` selects it so); the slow directories'
    tests are ``slow``; a ``cuda`` test skips where torch sees no CUDA GPU."""
    cuda = None
    for item in items:
        rel = Path(item.path).resolve().relative_to(ROOT).as_posix() if ROOT in Path(item.path).resolve().parents else ""
        top = rel.split("/")[0]
        if top == "parity_tests":
            item.add_marker(pytest.mark.parity)
        if top in SLOW_DIRECTORIES and rel not in FAST_FILES:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("cuda"):
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(scope="module")
def local_ray():
    """A Ray instance of this machine's two CPUs for one test module (the test module skips where Ray is missing)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()
