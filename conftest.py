"""Fixtures shared by tests/ and parity_tests/."""
import pytest


@pytest.fixture(scope="module")
def local_ray():
    """A Ray instance of this machine's two CPUs for one test module (the test module skips where Ray is missing)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()
