"""Test-session setup: without CUDA, Triton kernels run under the interpreter (TRITON_INTERPRET=1)
when a test asks for them; set before any kernel module is imported (Triton decides at decoration)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
