"""Fixtures for the facade tests: the side-by-side training helpers, and a host-sync counter."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def load_pair_module():
    """tests/compat/_torch_pair.py as a module (tests are imported by path, not as a package)."""
    name = "polyamp_tests_torch_pair"
    if name not in sys.modules:
        path = Path(__file__).with_name("_torch_pair.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def pair():
    """The side-by-side training helpers of tests/compat/_torch_pair.py."""
    pytest.importorskip("torch")
    return load_pair_module()


@pytest.fixture
def host_reads():
    """A context manager counting reads of tensor values by the host (.item(), bool(t), ...).

    Every such read runs aten._local_scalar_dense, the op behind a device synchronisation.
    """
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                self.count += 1
            return func(*args, **(kwargs or {}))

    return HostReads
