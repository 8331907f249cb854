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
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
