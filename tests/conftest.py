"""Test-session setup. Without a GPU, kernels run in Triton's CPU interpreter: TRITON_INTERPRET
must be set before triton is first imported (triton.language's own @jit helpers, e.g. tl.sigmoid,
are built at import and cannot be called from an interpreted kernel otherwise)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
