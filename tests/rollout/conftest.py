"""Rollout engine tests run the Triton kernels on a GPU, and under triton's CPU interpreter elsewhere (fp32;
the switch is in tests/conftest.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
