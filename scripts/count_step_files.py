"""Count the pagedserve source files one CPU decode step passes through, and the engine's lines.

A tiny random Llama (the tests' ``tests/engine/tiny_models.py``) runs on the CPU; after a
warm-up generation, a few requests are prefilled and then every ``EngineCore.step()`` call is
profiled with ``sys.setprofile``: a file counts once it runs a Python function during the
step. Steps where every request decodes are the ones reported (the first, prefill step is
not). ``--list`` prints the files of the last decode step.

    PYTHONPATH=$PWD .venv/bin/python scripts/count_step_files.py [--list]

docs/architecture.md#size quotes its output.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "pagedserve"


def engine_lines() -> tuple[int, int]:
    """(all lines, lines that are neither blank nor a ``#`` comment) of pagedserve/**/*.py."""
    total = code = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        for line in path.read_text().splitlines():
            total += 1
            stripped = line.strip()
            code += bool(stripped) and not stripped.startswith("#")
    return total, code


def build_tiny_model(folder: Path) -> None:
    sys.path.insert(0, str(REPO))
    from tests.engine.tiny_models import make_model, make_tokenizer

    tokenizer = make_tokenizer()
    model = make_model("llama", len(tokenizer), tokenizer.eos_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def profiled_steps(llm: Any, num_steps: int) -> list[tuple[set[str], set[str]]]:
    """Run ``num_steps`` engine steps as ``LLM`` does (core step, then output processing);
    per step, the pagedserve files the core step entered and those the whole step entered."""
    per_step: list[tuple[set[str], set[str]]] = []
    files: set[str] = set()
    root = str(PACKAGE) + "/"

    def ours(found: set[str]) -> set[str]:
        return {str(Path(f).relative_to(REPO)) for f in found if f.startswith(root)}

    def hook(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            files.add(frame.f_code.co_filename)

    for _ in range(num_steps):
        files = set()
        sys.setprofile(hook)
        try:
            outputs = llm.engine_core.step()
            core_files = set(files)
            llm.output_processor.process_outputs(outputs)
        finally:
            sys.setprofile(None)
        per_step.append((ours(core_files), ours(files)))
    return per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="print the decode step's files")
    parser.add_argument("--num-requests", type=int, default=4)
    args = parser.parse_args()

    from pagedserve import LLM, SamplingParams
    from pagedserve.outputs import RequestOutputKind

    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model(Path(tmp))
        llm = LLM(model=tmp, device="cpu", dtype="float32", max_num_seqs=8)
        params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True)
        llm.generate(["warm up the engine"] * args.num_requests, params, use_tqdm=False)
        prompts = [f"The capital of France {i}" for i in range(args.num_requests)]
        for request_id, prompt in enumerate(prompts):
            processed = llm.input_processor.process_inputs(f"count-{request_id}", prompt, params)
            llm.output_processor.add_request(processed, RequestOutputKind.DELTA)
            for request in processed.requests:
                llm.engine_core.add_request(request)
        steps = profiled_steps(llm, 8)
    decode_steps = steps[1:]  # steps[0] prefills the prompts
    core_counts = [len(core) for core, _ in decode_steps]
    all_counts = [len(whole) for _, whole in decode_steps]
    total, code = engine_lines()
    print(f"engine lines (pagedserve/**/*.py): {total} ({code} neither blank nor comment)")
    print(f"files one CPU decode step enters: EngineCore.step {statistics.median(core_counts):.0f}"
          f", with output processing {statistics.median(all_counts):.0f} "
          f"(per decode step: {core_counts}, {all_counts})")
    if args.list:
        core, whole = decode_steps[-1]
        print("\n".join(f"{'' if f in core else '+ '}{f}" for f in sorted(whole)))


if __name__ == "__main__":
    main()
