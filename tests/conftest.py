"""Runs before any test module is imported: without a GPU, Triton kernels run under triton's CPU interpreter.

TRITON_INTERPRET must be set before triton is first imported in the process (anything may import it: torch's
compiler stack, transformers), because triton decides then whether its own jit helpers (tl.sum, tl.max,
tl.rand) are interpreted; a later setting leaves them compiled-mode and interpreted kernels that call them fail.
"""

from __future__ import annotations

import os

import pytest

# One intra-op thread, here and in every process a test starts (they inherit it; a value the caller set stays): the
# tiny model's ops are too small for a second thread to pay, and the suite's machine has two cores
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def nondeterministic():
    """torch's deterministic mode off for one test, as it was after (a spec with `run.deterministic` sets it
    process-wide, and while it is on torch refuses kernels that accumulate with atomics, flash's backward too)."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(was)


@pytest.fixture
def cudnn_attention(nondeterministic):
    """SDPA may pick cuDNN for one test (while torch's deterministic mode is on it never does), as things were
    after: cuDNN's SDPA switched on."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(was)
