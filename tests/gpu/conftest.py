"""Kernel tests run on a real GPU when there is one, else under Triton's interpreter on the CPU.

The interpreter is chosen by TRITON_INTERPRET, which triton reads when it is first imported, so it
is set here, at conftest import time, before any test module imports triton.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
