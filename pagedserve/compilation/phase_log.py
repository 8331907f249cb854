"""Start-up phase records: one INFO log line per phase, with the figures as record fields.

Every start-up phase that this package and the worker time (compile, profile step, graph
captures, KV-cache allocation) logs through ``log_phase``. The message is for people; the
``extra`` fields (``startup_phase``, ``startup_seconds`` and the phase's own figures) are for
tools: ``benchmarks/startup_check.py`` collects them with a logging handler instead of parsing
text.
"""

from __future__ import annotations

import logging
from typing import Any

PHASE_FIELD = "startup_phase"
SECONDS_FIELD = "startup_seconds"
FIGURES_FIELD = "startup_figures"
KV_BUDGET_FIELD = "kv_budget"
"""Field of the KV budget's log line (worker/profile.py): the MemoryProfile's terms, bytes."""


def log_phase(logger: logging.Logger, phase: str, seconds: float, detail: str = "",
              **figures: Any) -> None:
    """``start-up: <phase> took <seconds> s (<detail>)``; ``figures`` ride along as fields."""
    suffix = f" ({detail})" if detail else ""
    logger.info(
        "start-up: %s took %.2f s%s", phase, seconds, suffix,
        extra={PHASE_FIELD: phase, SECONDS_FIELD: seconds, FIGURES_FIELD: figures},
    )  # fmt: skip
