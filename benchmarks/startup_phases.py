"""Start-up of the Llama-3-8B shape, from process start: imports, CUDA context, then ``LLM()``.

``python benchmarks/startup_phases.py MODE OUTDIR [--cprofile]`` with MODE ``fast`` (compile
and CUDA graphs) or ``eager``. Prints the time since process start after ``import torch``, the
CUDA context, ``import transformers``, ``from pagedserve import LLM`` and ``LLM(...)`` ready
(the engine logs its own phases at INFO); writes them to OUTDIR/startup_<mode>_marks.json, and
with ``--cprofile`` the profile of ``LLM(...)`` (cumulative and own time, top 60). Run it twice
with the same ``XDG_CACHE_HOME`` for a cold and a warm start.
"""

import time

T0 = time.perf_counter()

import cProfile  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import pstats  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
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
    if prof is not None:
        for key in ("cumulative", "tottime"):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(key).print_stats(60)
            (out / f"startup_{tag}_{key}.txt").write_text(text.getvalue())
    (out / f"startup_{tag}_marks.json").write_text(json.dumps(marks))


if __name__ == "__main__":
    main()
