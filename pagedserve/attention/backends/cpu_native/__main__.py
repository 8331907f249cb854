"""``python -m pagedserve.attention.backends.cpu_native``: build the CPU's C kernels now, all at
once (``scripts/install.sh`` runs it), instead of one after another at the first start. Exit
status 1 if any failed to build (the engine then runs that part on the torch path)."""

from __future__ import annotations

import sys
import time

from pagedserve.attention.backends.cpu_native import build_all


def main() -> int:
    start = time.perf_counter()
    failures = {source: error for source, error in build_all().items() if error is not None}
    for source, error in failures.items():
        print(f"pagedserve: C kernel {source.name} not built: {error}", file=sys.stderr)
    print(f"pagedserve: CPU kernels ready in {time.perf_counter() - start:.1f} s"
          + (f", {len(failures)} not built" if failures else ""), file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
