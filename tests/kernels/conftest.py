"""Kernel tests run the real kernels on a GPU and under triton's CPU interpreter elsewhere.

TRITON_INTERPRET must be set before the kernel modules are imported (triton.jit reads it at decoration time),
hence here; the shared helpers live in `kernels_testkit`. Under the interpreter the tensors are fp32: triton
3.6's (and 3.9's) interpreter multiplies the raw bit patterns of bf16 operands in tl.dot. Without triton the
kernel tests skip (pytest.importorskip). Triton itself may already be imported by then (torch._dynamo imports
it): the kernels therefore call only builtins of triton.language, see `rollplex.kernels.tiles.zero_tile`.
"""

from __future__ import annotations

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
