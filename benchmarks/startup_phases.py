"""Start-up of the Llama-3-8B shape, from process start: imports, CUDA context, then ``LLM()``.

``python benchmarks/startup_phases.py MODE OUTDIR [--cprofile | --sample]`` with MODE ``fast``
(compile and CUDA graphs) or ``eager``. Prints the time since process start after ``import
torch``, the CUDA context, ``import transformers``, ``from pagedserve import LLM`` and ``LLM(...)``
ready (the engine logs its own phases at INFO); writes them to OUTDIR/startup_<mode>_marks.json.
``--cprofile`` writes the profile of ``LLM(...)`` (cumulative and own time, top 60, and the raw
``.prof`` for ``pstats``); cProfile's cost per call inflates Python-heavy code. ``--sample``
instead records the main thread's stack about every 10 ms from process start to ready (wall time,
imports included) and writes ``startup_<mode>_sample_stacks.txt`` (collapsed stacks, the input
of flame-graph tools) and ``startup_<mode>_sample_top.txt`` (seconds under each function and
each module file, inclusive). Run it twice with the same ``XDG_CACHE_HOME`` for a cold and a
warm start.
"""

import time

T0 = time.perf_counter()

import sys  # noqa: E402
import threading  # noqa: E402
from collections import Counter  # noqa: E402

SAMPLE_S = 0.01


class StackSampler(threading.Thread):
    """Counts the main thread's stacks (outermost first, ``file:function`` frames) every
    ``SAMPLE_S`` seconds until stopped; a sample waits for the GIL, so it lands between
    bytecodes or while the main thread is in C code that released it."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.main_id = threading.main_thread().ident
        self.stacks: Counter[tuple[str, ...]] = Counter()
        self.running = True

    def run(self) -> None:
        while self.running:
            frame = sys._current_frames().get(self.main_id)
            stack = []
            while frame is not None:
                stack.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")
                frame = frame.f_back
            self.stacks[tuple(reversed(stack))] += 1
            time.sleep(SAMPLE_S)

    def write(self, stacks_path, top_path) -> None:
        self.running = False
        self.join()  # its last sample lands before the counts are read
        elapsed = time.perf_counter() - T0
        samples = sum(self.stacks.values())
        per_sample = elapsed / max(1, samples)  # sleeps overshoot SAMPLE_S
        lines = [f"{';'.join(stack)} {count}" for stack, count in self.stacks.most_common()]
        stacks_path.write_text("\n".join(lines) + "\n")
        by_function: Counter[str] = Counter()
        by_file: Counter[str] = Counter()
        for stack, count in self.stacks.items():
            for frame in set(stack):  # inclusive: once per sample however deep the recursion
                by_function[frame] += count
            for path in {frame.rsplit(":", 1)[0] for frame in stack}:
                by_file[path] += count
        text = [f"{samples} samples over {elapsed:.2f} s"]
        for title, counter in (("function", by_function), ("file", by_file)):
            text.append(f"\nseconds under each {title} (inclusive), top 80")
            text += [f"{n * per_sample:8.2f}  {name}" for name, n in counter.most_common(80)]
        top_path.write_text("\n".join(text) + "\n")


SAMPLER = StackSampler() if "--sample" in sys.argv else None
if SAMPLER is not None:
    SAMPLER.start()

import cProfile  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import pstats  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

CONFIG = Path(__file__).resolve().parent / "model-configs" / "llama-3-8b.json"


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    tag = mode + ("_prof" if "--cprofile" in sys.argv else "")
    out.mkdir(parents=True, exist_ok=True)
    marks: dict[str, float] = {}

    def mark(name: str) -> None:
        marks[name] = round(time.perf_counter() - T0, 2)
        print(f"[{mode}] {name} {marks[name]}", flush=True)

    import torch

    mark("import torch")
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    mark("cuda context")
    import transformers  # noqa: F401

    mark("import transformers")
    from pagedserve import LLM

    mark("import pagedserve")
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    work = Path(tempfile.mkdtemp())
    shutil.copy(CONFIG, work / "config.json")
    prof = cProfile.Profile() if "--cprofile" in sys.argv else None
    if prof is not None:
        prof.enable()
    LLM(model=str(work), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
        max_model_len=4096, gpu_memory_utilization=0.9, enforce_eager=mode == "eager")
    if prof is not None:
        prof.disable()
    mark("LLM ready")
    if SAMPLER is not None:
        SAMPLER.write(out / f"startup_{mode}_sample_stacks.txt",
                      out / f"startup_{mode}_sample_top.txt")
    if prof is not None:
        prof.dump_stats(out / f"startup_{tag}.prof")
        for key in ("cumulative", "tottime"):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(key).print_stats(60)
            (out / f"startup_{tag}_{key}.txt").write_text(text.getvalue())
    (out / f"startup_{tag}_marks.json").write_text(json.dumps(marks))


if __name__ == "__main__":
    main()
