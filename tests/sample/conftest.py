"""Fixtures for the sampler tests."""

from __future__ import annotations

import pytest
import torch

from tests.sample.sampling_helpers import DEVICES


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)
