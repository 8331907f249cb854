#!/usr/bin/env bash
# Build the offline vLLM 0.25.1 payload for the GPU machine (Python 3.12, torch 2.11.0+cu130)
# from PyPI, into DIR (default ./.peer-vllm, which git ignores). Then see README.md.
# The payload is ~102 MB: more than one device call carries (64 MiB), so it is split.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-.peer-vllm}; mkdir -p "$out"/wheels "$out"/wheels-if-missing "$out"/tmp
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64
      --platform manylinux_2_5_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$out"/tmp vllm==0.25.1
python3 -m pip download -q --no-deps "${plat[@]}" -d "$out"/wheels -r "$here"/wheels.txt
python3 -m pip download -q --no-deps "${plat[@]}" -d "$out"/wheels-if-missing -r "$here"/wheels-if-missing.txt
rm -rf "$out"/tmp/x && mkdir "$out"/tmp/x && (cd "$out"/tmp/x && unzip -q ../vllm-0.25.1-*.whl)
# Not needed for a bf16 Llama on Hopper (FA3 is used; MoE, the Rust frontend, DeepGEMM and
# Blackwell FMHA are never imported on that path).
(cd "$out"/tmp/x/vllm && rm -f vllm_flash_attn/_vllm_fa2_C.abi3.so _moe_C_stable_libtorch.abi3.so vllm-rs \
   && rm -rf third_party/deep_gemm third_party/fmha_sm100)
(cd "$out"/tmp/x && tar -cf - vllm vllm-0.25.1.dist-info | xz -T0 --x86 --lzma2=preset=9e > ../vllm-stripped.tar.xz)
(cd "$out" && split -b 55M tmp/vllm-stripped.tar.xz vllm-stripped.tar.xz.part-)
cp "$here"/install.sh "$out"/ && mkdir -p "$out"/llama3-8b
cp "$here"/../../model-configs/llama-3-8b.json "$out"/llama3-8b/config.json
rm -rf "$out"/tmp
ls -la "$out"
