import atexit
import os
import shutil
import socket
import tempfile

import pytest
import torch

# Commands that run a model default to --precision auto, which picks bf16 or fp32 by this machine's CPU and a
# measurement: the tests pin fp32 (their references are fp32) and test auto itself with mocked answers
# (tests/test_hardware.py). Measurements go to a cache of this test session, not the user's.
os.environ["TOKENLOOM_PRECISION"] = "fp32"
os.environ.setdefault("TOKENLOOM_DEVICE", "cpu")  # the commands' --device (tests/devices/test_gpu.py: cuda)
os.environ["TOKENLOOM_CACHE_DIR"] = tempfile.mkdtemp(prefix="tokenloom-test-cache-")
atexit.register(shutil.rmtree, os.environ["TOKENLOOM_CACHE_DIR"], ignore_errors=True)
# Inductor's on-disk cache does not key on ATEN_CPU_CAPABILITY (torch 2.13): kernels another process compiled under
# other forced kernels load and fail (index out of bounds) or abort. The suite compiles into a cache of its own per
# kernel setting (kept between runs: warm), unless one is given.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"tokenloom-tests-inductor-{os.getuid() if hasattr(os, 'getuid') else 'user'}-"
    f"{os.environ.get('ATEN_CPU_CAPABILITY', 'native').lower() or 'native'}"))

# The fuzzers (tests marked `fuzz`: hypothesis property tests, schemathesis against the server) run a short,
# derandomised pass in `make test` and a long, random one in `make test-fuzz` (HYPOTHESIS_PROFILE=fuzz, in CI).
try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("default", max_examples=40, deadline=None, derandomize=True, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    settings.register_profile("fuzz", max_examples=400, deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
except ImportError:  # the dev extra is not installed: the fuzz tests skip themselves (importorskip)
    pass


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(2)
    yield


@pytest.fixture
def no_network(monkeypatch):
    """HF_HUB_OFFLINE=1, and any connection attempt fails the test (the Hugging Face cache and datasets tests)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[1:]}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
