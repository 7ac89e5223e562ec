"""Kernel tests run the real kernels on a GPU and under triton's CPU interpreter elsewhere.

The interpreter switch (TRITON_INTERPRET) is set in tests/conftest.py, before anything imports triton; the
shared helpers live in `kernels_testkit`. Under the interpreter the tensors are fp32: triton 3.6's (and 3.9's)
interpreter multiplies the raw bit patterns of bf16 operands in tl.dot.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
