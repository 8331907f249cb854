#!/usr/bin/env bash
# Install (CPU torch, test extras) and run the whole test suite. Triton kernels run under the
# interpreter on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test,serve
export TRITON_INTERPRET=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
