"""Fixtures of the kernel tests."""

import pytest
import torch

import temper_kernels as kernels


@pytest.fixture
def triton_mode(monkeypatch):
    """The Triton kernels, not the torch twins: on a machine without CUDA they run under TRITON_INTERPRET=1."""
    monkeypatch.setenv("TEMPER_KERNELS", "triton")
    if not torch.cuda.is_available():
        assert kernels.interpreting(), "tests/conftest.py sets TRITON_INTERPRET=1 before kernels is imported"
