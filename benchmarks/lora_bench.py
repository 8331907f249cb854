"""What serving LoRA adapters costs on the GPU: the Llama-3-8B shape (dummy weights), one
engine after another in this process, without LoRA and with ``enable_lora`` at each
``--max-loras`` (random PEFT-format adapters of rank ``--rank`` on all seven projections).

For each engine: the decode step at batch 1 and 64 (context ~1024; ``(T(128) - T(1)) / 127``
as ``pagedserve bench latency`` measures it), of requests without an adapter and, with
LoRA, of requests taking the adapters in turn; then a throughput run whose requests take the
adapters in turn (``--prompts`` x ``--input-len`` / ``--output-len``). One JSON line
per engine goes to ``OUT/lora_bench.json``.

    python benchmarks/lora_bench.py --out $OUT
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedserve import LLM, LoRARequest, SamplingParams

CONFIGS = Path(__file__).resolve().parent / "model-configs"


def module_shapes(config: dict) -> dict[str, tuple[str, int, int]]:
    """module -> (parent, in_features, out_features) of a Llama-family config.json."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, config.get("num_key_value_heads", heads) * head_dim
    return {"q_proj": ("self_attn", hidden, q), "k_proj": ("self_attn", hidden, kv),
            "v_proj": ("self_attn", hidden, kv), "o_proj": ("self_attn", q, hidden),
            "gate_proj": ("mlp", hidden, inter), "up_proj": ("mlp", hidden, inter),
            "down_proj": ("mlp", inter, hidden)}


def write_adapter(folder: Path, config: dict, rank: int, seed: int) -> None:
    """A random adapter in PEFT's layout (small values: the tokens stay sensible)."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (parent, fan_in, fan_out) in shapes.items():
            name = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{name}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g)
                                                * 0.01).bfloat16()
            tensors[f"{name}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g)
                                                * 0.01).bfloat16()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                      "target_modules": list(shapes), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config))


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 30000, (count, length), generator=g).tolist()


def decode_step_ms(llm: LLM, batch: int, context: int, adapters: list[LoRARequest]) -> float:
    """The step of ``batch`` requests at ``context`` tokens, the requests taking ``adapters``
    in turn (none: the base model)."""
    batch_prompts = [{"prompt_token_ids": p} for p in prompts(batch, context, batch)]
    lora = [adapters[i % len(adapters)] if adapters else None for i in range(batch)]
    timings = {}
    for max_tokens in (1, 128, 1, 128):  # the first pair warms up
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(batch_prompts, params, use_tqdm=False, lora_request=lora)
        timings[max_tokens] = time.perf_counter() - start
    return (timings[128] - timings[1]) / 127 * 1e3


def throughput(llm: LLM, args: argparse.Namespace, adapters: list[LoRARequest]) -> float:
    batch = [{"prompt_token_ids": p} for p in prompts(args.prompts, args.input_len, 7)]
    lora = [adapters[i % len(adapters)] if adapters else None for i in range(len(batch))]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(batch[:8], params, use_tqdm=False, lora_request=lora[:8])  # warm-up
    start = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False, lora_request=lora)
    return args.prompts * args.output_len / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--config", default="llama-3-8b.json", help="in model-configs/")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--max-loras", default="1,4", help="one engine per value (0: no LoRA)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp())
    model = work / "model"
    model.mkdir()
    shutil.copy(CONFIGS / args.config, model / "config.json")
    config = json.loads((model / "config.json").read_text())
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    for max_loras in [0, *map(int, args.max_loras.split(","))]:
        adapters = [LoRARequest(f"a{i}", i + 1, str(work / f"a{i}")) for i in range(max_loras)]
        for i, adapter in enumerate(adapters):
            if not Path(adapter.lora_path).exists():
                write_adapter(Path(adapter.lora_path), config, args.rank, i)
        lora = dict(enable_lora=True, max_loras=max_loras, max_lora_rank=args.rank) \
            if max_loras else {}
        start = time.perf_counter()
        llm = LLM(str(model), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                  gpu_memory_utilization=0.5, max_num_seqs=256, max_model_len=4096, **lora)
        row = {"max_loras": max_loras, "rank": args.rank if max_loras else 0,
               "start_s": round(time.perf_counter() - start, 1),
               **{f"b{b}_step_ms": round(decode_step_ms(llm, b, args.context, []), 3)
                  for b in batch_sizes},
               **{f"b{b}_adapter_step_ms": round(decode_step_ms(llm, b, args.context,
                                                                adapters), 3)
                  for b in (batch_sizes if adapters else [])},
               "throughput_tok_s": round(throughput(llm, args, adapters), 1),
               "workload": f"{args.prompts} x {args.input_len}/{args.output_len}",
               "model": args.config,
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
        print(json.dumps(row), flush=True)
        with open(out / "lora_bench.json", "a") as f:
            f.write(json.dumps(row) + "\n")
        llm.engine_core.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
