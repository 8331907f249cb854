"""Kernel tests run under the Triton CPU interpreter, which must be chosen before triton loads."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
