"""benchmarks/vs_vllm.py on the CPU: its arguments, the plan of runs, the side-by-side table
from JSON lines, and a whole ``run`` against a stand-in for the peer's bench_vllm.py (the
real engines need a GPU)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.benchmarks.script_loader import loaded_script

FAKE_PEER = '''
import json, sys
args = sys.argv[1:]
workload = args[args.index("--workload") + 1]
seqs = int(args[args.index("--max-num-seqs") + 1])
figure = ({"decode_ms_per_step": 4.94} if workload.startswith("latency")
          else {"output_tokens_per_s": 8429.0 if seqs == 1024 else 9563.0})
print("[bench] noise")
print(json.dumps({"engine": "vllm", "workload": workload, "startup_s": 84.0, **figure}))
'''


@pytest.fixture(scope="module")
def vs() -> Iterator[ModuleType]:
    with loaded_script("vs_vllm") as module:
        yield module


def test_arguments(vs: ModuleType) -> None:
    args = vs.parse_args(["run", "--out", "o"])
    assert args.engines == ["pagedserve", "vllm"] and args.max_num_seqs == [256, 1024]
    assert args.workloads == ["b1", "b64", "t1000", "t2048", "cold"] and args.num_prompts is None
    args = vs.parse_args(["run", "--out", "o", "--workloads", "t2048", "--max-num-seqs", "1024",
                          "--num-prompts", "300", "--engines", "vllm"])
    assert (args.workloads, args.max_num_seqs, args.num_prompts) == (["t2048"], [1024], 300)
    for bad in (["--workloads", "t999"], ["--engines", "sglang"], ["--max-num-seqs", "x"]):
        with pytest.raises(SystemExit):
            vs.parse_args(["run", "--out", "o", *bad])


def test_plan_groups_pagedserve_and_splits_vllm(vs: ModuleType) -> None:
    runs = vs.plan(vs.parse_args(["run", "--out", "o"]))
    assert [(r.engine, r.workloads, r.max_num_seqs) for r in runs] == [
        ("pagedserve", ("b1", "b64", "t1000", "t2048"), 256),
        ("pagedserve", ("t1000", "t2048"), 1024),
        ("vllm", ("b1",), 256), ("vllm", ("b64",), 256), ("vllm", ("t1000",), 256),
        ("vllm", ("t2048",), 256), ("vllm", ("t1000",), 1024), ("vllm", ("t2048",), 1024),
    ]
    first_only = vs.plan(vs.parse_args(["run", "--out", "o", "--engines", "vllm",
                                        "--first-only", "t2048"]))
    assert [(r.workloads, r.max_num_seqs) for r in first_only] == [
        (("b1",), 256), (("b64",), 256), (("t2048",), 256), (("t1000",), 256),
        (("t1000",), 1024)]
    with pytest.raises(SystemExit):
        vs.parse_args(["run", "--out", "o", "--first-only", "cold"])
    cold_only = vs.plan(vs.parse_args(["run", "--out", "o", "--workloads", "cold"]))
    assert [(r.engine, r.workloads) for r in cold_only] == [("pagedserve", ()), ("vllm", ())]
    full = vs.parse_args(["run", "--out", "o"])
    half = vs.parse_args(["run", "--out", "o", "--num-prompts", "500"])
    assert vs.print_plan(vs.plan(half), half) < vs.print_plan(vs.plan(full), full)


def _rec(vs: ModuleType, engine: str, workload: str, seqs: int, value: float) -> dict:
    return vs.record(engine, workload, seqs, value, {})


def test_table_prints_each_figure_beside_the_other_and_the_ratio(vs: ModuleType) -> None:
    records = [
        _rec(vs, "pagedserve", "cold", 256, 32.0), _rec(vs, "vllm", "cold", 256, 80.0),
        _rec(vs, "pagedserve", "b1", 256, 4.1), _rec(vs, "vllm", "b1", 256, 5.0),
        _rec(vs, "pagedserve", "t1000", 256, 9780.0), _rec(vs, "vllm", "t1000", 256, 9563.0),
        _rec(vs, "pagedserve", "t1000", 1024, 8904.0),
        _rec(vs, "vllm", "error", 1024, 0.0),
    ]
    lines = vs.format_table(records).splitlines()
    assert "| b1 (ms) | 256 | 4.10 | 5.00 | 0.82x the time |" in lines
    assert "| t1000 (output tok/s) | 256 | 9,780 | 9,563 | 1.02x |" in lines
    assert "| t1000 (output tok/s) | 1024 | 8,904 | — | — |" in lines
    assert "| cold (s) | — | 32.00 | 80.00 | 0.40x the time |" in lines
    rows = [line.split(" (")[0] for line in lines if line.startswith("| ") and "(" in line]
    assert rows == ["| b1", "| t1000", "| t1000", "| cold"]  # workload order, then sequences
    assert lines[-1].startswith("error: vllm")


def test_run_against_a_stand_in_peer(vs: ModuleType, tmp_path: Path, capsys) -> None:
    peer = tmp_path / "peer"
    (peer / "llama3-8b").mkdir(parents=True)
    (tmp_path / "bench_vllm.py").write_text(FAKE_PEER)
    out = tmp_path / "out"
    vs.main(["run", "--out", str(out), "--peer", str(peer), "--engines", "vllm",
             "--workloads", "b64,t1000,cold", "--vllm-pythonpath", str(tmp_path),
             "--vllm-bench", str(tmp_path / "bench_vllm.py")])
    records = [json.loads(line) for line in (out / vs.RESULTS).read_text().splitlines()]
    assert [(r["workload"], r["max_num_seqs"], r["value"]) for r in records] == [
        ("cold", 256, 84.0), ("b64", 256, 4.94), ("start", 256, 84.0), ("t1000", 256, 9563.0),
        ("start", 1024, 84.0), ("t1000", 1024, 8429.0)]
    table = capsys.readouterr().out
    assert "| b64 (ms) | 256 | — | 4.94 | — |" in table
    vs.main(["table", str(out)])
    assert "| t1000 (output tok/s) | 1024 | — | 8,429 | — |" in capsys.readouterr().out


def test_energy_of_the_timed_window(vs: ModuleType) -> None:
    samples = [(float(t), 100.0 + 700.0 * t) for t in range(11)]  # 700 W from t = 0 to 10 s
    assert vs.energy_between(samples, 2.5, 6.5) == pytest.approx(2800.0)
    assert vs.energy_between(samples, 2.5, 12.0) is None  # the window ran past the samples
    done = vs.TimedRun(0, [(1.0, "[bench] noise\n"), (2.0, vs.VLLM_READY_LINE + " in 9 s\n")],
                       "", samples)
    figures = vs.vllm_energy(done, {"wall_s": 5.0, "output_tokens": 7000})
    assert figures == {"energy_j": 3500.0, "output_tok_per_j": 2.0}
    assert vs.vllm_energy(done, {"decode_ms_per_step": 4.9}) == {}  # a latency run


def test_table_gives_tokens_per_joule_beside_throughput(vs: ModuleType) -> None:
    ours = vs.record("pagedserve", "t1000", 256, 9780.0, {"output_tok_per_j": 14.0})
    theirs = vs.record("vllm", "t1000", 256, 9563.0, {"output_tok_per_j": 12.5})
    lines = vs.format_table([ours, theirs]).splitlines()
    assert "| t1000 (output tok/J) | 256 | 14.00 | 12.50 | 1.12x |" in lines


def test_fp8_options_reach_both_engines(vs: ModuleType) -> None:
    args = vs.parse_args(["run", "--out", "o", "--quantization", "fp8",
                          "--kv-cache-dtype", "fp8"])
    assert vs.precision(args) == "fp8 weights + fp8 KV"
    assert vs.precision(vs.parse_args(["run", "--out", "o"])) == "bf16"
    with pytest.raises(SystemExit):
        vs.parse_args(["run", "--out", "o", "--quantization", "int4"])
    ours, _ = vs.command(vs.Run("pagedserve", ("t1000",), 1024), args)
    child = vs.parse_args(ours[ours.index("child"):])
    assert (child.quantization, child.kv_cache_dtype) == ("fp8", "fp8")
    theirs, env = vs.command(vs.Run("vllm", ("t1000",), 1024), args)
    assert theirs[1] == str(vs.VLLM_BENCH) and env["PYTHONPATH"] == args.vllm_pythonpath
    with loaded_script("peers/vllm/bench_vllm") as peer:
        parsed = peer.parse_args([*theirs[2:], "--dry-run"])
        assert (parsed.quantization, parsed.kv_cache_dtype, parsed.max_num_seqs) == (
            "fp8", "fp8", 1024)
        assert peer.run(parsed)["kv_cache_dtype"] == "fp8"  # a dry run: the prompts, no vLLM


def test_table_keeps_precisions_apart(vs: ModuleType) -> None:
    bf16 = _rec(vs, "pagedserve", "t1000", 1024, 8000.0)
    fp8 = {**_rec(vs, "pagedserve", "t1000", 1024, 12000.0), "precision": "fp8 weights"}
    peer = {**_rec(vs, "vllm", "t1000", 1024, 10000.0), "precision": "fp8 weights"}
    lines = vs.format_table([fp8, bf16, peer]).splitlines()
    assert lines[2:] == ["| t1000 (output tok/s) | 1024 | 8,000 | — | — |",
                         "| t1000, fp8 weights (output tok/s) | 1024 | 12,000 | 10,000 | 1.20x |"]
