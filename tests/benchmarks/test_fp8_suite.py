"""``benchmarks/fp8_suite.py``'s arguments and its side-by-side table (no GPU needed)."""

from __future__ import annotations

import sys

import pytest

from tests.benchmarks.script_loader import loaded_script


@pytest.mark.parametrize("prompts", ["0", "-5"])
def test_a_70b_prompt_count_below_one_is_refused(prompts: str, tmp_path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with loaded_script("fp8_suite") as suite:
        monkeypatch.setattr(sys, "argv", ["fp8_suite.py", "--out", str(tmp_path),
                                          "--prompts-70b", prompts])
        with pytest.raises(SystemExit) as stopped:
            suite.main()
    assert stopped.value.code == 2
    assert "--prompts-70b: must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "fp8.json").exists()


def test_the_table_names_the_70b_prompt_count() -> None:
    with loaded_script("fp8_suite") as suite:
        rows = {("70b.fp8", "t1000_70b"): {"output_tok_per_s": 3000.0, "num_prompts": 1000}}
        lines = suite.side_by_side(rows)
    assert "1000/1000 with 1,000.00 prompts: 3,000.00 output tok/s" in lines[-1]
