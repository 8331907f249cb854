#!/usr/bin/env bash
# Install (CPU torch, test extras), lint (ruff), type-check (mypy, configured in pyproject.toml)
# and run the whole test suite. Triton kernels run under the interpreter on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test,serve
# Headless Chromium for the web page's browser tests (Debian's package; CI runs as root).
if ! command -v chromium >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
.venv/bin/python -m ruff check pagedserve tests benchmarks
.venv/bin/python -m mypy
export TRITON_INTERPRET=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# pytest keeps its assertion-rewritten modules only where bytecode may be written: without
# that, each of the three pytest processes below rewrites every test module and plugin again.
unset PYTHONDONTWRITEBYTECODE
# anyio's and schemathesis' pytest plugins are unused (the fuzz test calls schemathesis itself).
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider -p no:anyio -p no:schemathesis)
# Arguments: one plain pytest run of them (a file, -k, -m serial, -n 2 --dist loadfile...).
if [ $# -gt 0 ]; then
  exec "${pytest[@]}" "$@"
fi
# Two workers, a whole file each (its module fixtures are built once), longest files first
# (tests/conftest.py); then the tests marked serial (wall time, memory), alone on the machine.
# Both passes run; the script fails if either does.
status=0
start=$SECONDS
"${pytest[@]}" -n 2 --dist loadfile -m "not serial" --durations=15 || status=$?
echo "parallel pass: $((SECONDS - start)) s"
start=$SECONDS
"${pytest[@]}" -m serial --durations=15 || status=$?
echo "serial pass: $((SECONDS - start)) s"
exit "$status"
