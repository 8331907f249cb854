"""Where the kernel tests run their kernels: on the GPU of a CUDA machine with the interpreter
off (the kernels compile for the card), else on the CPU under TRITON_INTERPRET=1 (CI)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def on_kernel_device(kernel: Callable[..., Any], *args: Any) -> Any:
    """``kernel(*args)`` with its tensor arguments on DEVICE, each copied back afterwards (the
    outputs among them), so a test can keep its tensors and expectations on the CPU."""
    moved = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    result = kernel(*moved)
    for arg, dev in zip(args, moved, strict=True):
        if isinstance(arg, torch.Tensor) and dev is not arg:
            arg.copy_(dev)
    return result
