"""docs/configuration.md lists every engine option and sampling field the code has, no more,
and each flag it names is one the CLI accepts."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from pagedserve.config import EngineConfig
from pagedserve.entrypoints.cli import main
from pagedserve.sampling_params import SamplingParams

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
ROW = re.compile(r"^\| `(\w+)` (?:/ `(--[\w-]+))?")


def _section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start : end if end != -1 else None]


def _documented(*titles: str) -> dict[str, str | None]:
    rows = {}
    for title in titles:
        for line in _section(title).splitlines():
            match = ROW.match(line)
            if match:
                rows[match.group(1)] = match.group(2)
    return rows


def test_every_engine_option_documented_with_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    documented = _documented("## Engine\n", "## Model (", "## KV cache (", "## Scheduler (",
                             "## Parallelism (", "## Compilation ", "## LoRA adapters (")
    config = EngineConfig()
    sections = [getattr(config, f.name) for f in dataclasses.fields(config)]
    fields = {"device"} | {f.name for section in sections if dataclasses.is_dataclass(section)
                           for f in dataclasses.fields(section)}
    assert set(documented) == fields
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    known = set(re.findall(r"--[\w-]+", capsys.readouterr().out))
    for name, flag in documented.items():
        assert flag == "--" + name.replace("_", "-"), name
        assert flag in known, flag


def test_every_sampling_field_documented() -> None:
    rows = [ROW.match(line) for line in _section("## Sampling (").splitlines()]
    documented = {m.group(1) for m in rows if m}
    assert documented == {f.name for f in dataclasses.fields(SamplingParams)}
