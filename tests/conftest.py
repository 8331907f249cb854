"""Suite-wide hooks: file-level scheduling for pytest-xdist, longest files first, and the
seconds each file took.

``scripts/test.sh`` runs the suite on two workers with ``--dist loadfile``: every test of a file
runs on one worker, so a module's fixtures (engines, servers) are built once. Files are handed
out longest first (by ``file_durations.json``, seconds measured on a parallel run), so that a
long file does not start last while the other worker idles. The reliability tests form one
unit: their session fixture starts every server that the collected tests ask for, which must
happen on one worker only. So do the OpenAI server tests, whose shared server then starts once.

``--durations N`` also prints the N slowest files; ``--save-file-durations PATH`` writes every
file's seconds as JSON, the format of ``file_durations.json``, which a parallel pass refreshes:
``bash scripts/test.sh -n 2 --dist loadfile -m "not serial" --save-file-durations
tests/file_durations.json``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

DURATIONS_FILE = Path(__file__).with_name("file_durations.json")
DEFAULT_SECONDS = 5.0
"""The guess for a file that ``file_durations.json`` does not list."""
GROUPED_FOLDERS = ("tests/reliability/", "tests/entrypoints/openai/")
"""Folders whose test files run on one worker, together."""


def work_unit(nodeid: str) -> str:
    """The test's file, or the folder of ``GROUPED_FOLDERS`` it is in."""
    path = nodeid.split("::", 1)[0]
    return next((folder for folder in GROUPED_FOLDERS if path.startswith(folder)), path)


def expected_seconds(unit: str, durations: dict[str, float]) -> float:
    """A file's recorded seconds, a folder's sum over its files; ``DEFAULT_SECONDS`` if none."""
    if unit in durations:
        return durations[unit]
    return sum(s for path, s in durations.items() if path.startswith(unit)) or DEFAULT_SECONDS


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--save-file-durations", metavar="PATH", default=None,
                     help="write each test file's seconds (setup, call, teardown) as JSON")


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)  # one core per worker: two workers share two cores


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    """Each test starts from the same torch random state, whichever tests ran before it in its
    process (a worker is handed files in an order that changes from run to run)."""
    import torch

    torch.manual_seed(0)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist may not be installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, longest unit first; other modes are left to xdist."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    durations: dict[str, float] = json.loads(DURATIONS_FILE.read_text())

    class LongestFileFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            longest = max(self.workqueue, key=lambda unit: expected_seconds(unit, durations))
            self.workqueue.move_to_end(longest, last=False)  # the base class pops the first
            super()._assign_work_unit(node)

    return LongestFileFirst(config, log)


def file_seconds(reports: dict[str, list[Any]]) -> Counter[str]:
    """Seconds of each test file: the sum over its tests' setup, call and teardown."""
    seconds: Counter[str] = Counter()
    for report in (r for group in reports.values() for r in group):
        if isinstance(report, pytest.TestReport):
            seconds[report.nodeid.split("::", 1)[0]] += report.duration
    return seconds


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    seconds = file_seconds(terminalreporter.stats)
    count = config.getoption("durations")
    if count is not None and seconds:
        terminalreporter.write_sep("=", f"slowest {count or len(seconds)} files")
        for path, total in seconds.most_common(count or None):
            terminalreporter.write_line(f"{total:8.2f}s {path}")
    target = config.getoption("save_file_durations")
    if target:
        rounded = {path: round(total, 1) for path, total in sorted(seconds.items())}
        Path(target).write_text(json.dumps(rounded, indent=1) + "\n")
