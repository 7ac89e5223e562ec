"""Rollout engine tests run the Triton kernels on a GPU, and under triton's CPU interpreter elsewhere (fp32).

TRITON_INTERPRET must be set before `rollplex.kernels` is imported; see tests/kernels/conftest.py.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
