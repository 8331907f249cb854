"""Structured outputs against free decoding on the same prompts, with the public offline API.

``python benchmarks/structured.py --out DIR`` builds the Llama-3-8B shape with dummy bf16
weights on a CUDA machine; ``--preset tiny`` builds a tiny fp32 Llama on the CPU instead (a
smoke test of the same code). ``suite.py --sections structured`` runs ``run`` on the suite's 8B
engine. Three figures, each printed constrained beside unconstrained:

- **Throughput:** ``batch`` prompts, each constrained by the ten-field JSON schema of
  ``pagedserve bench serve --structured json-schema`` with up to ``output_len`` tokens. Dummy
  weights give random tokens, so a constrained answer is valid JSON that may end early (its
  grammar completes). The unconstrained run therefore gets, prompt by prompt, exactly the
  number of tokens the constrained answer had (``ignore_eos``): both runs produce the same
  tokens per request, and tok/s counts the tokens actually produced. Pairs are repeated and
  the median ratio reported (target >= 0.9).
- **Batch-1 decode step:** the median wall time of ``LLM.step()`` with one request running,
  past its prefill; a constrained request that ends early is followed by another until
  ``step_samples`` steps were timed (target: at most 0.3 ms more than unconstrained).
- **Time to first token** with ``load`` free requests decoding: of a free request, of one
  with the already compiled schema, and of one with a schema never seen (compiled then).

The tokenizer the grammar compiler needs is synthetic (``synthetic_tokenizer``): a dummy
model folder has none, and the GPU machine cannot download one.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pagedserve import LLM, SamplingParams, StructuredOutputsParams
from pagedserve.entrypoints.bench.common import random_prompts
from pagedserve.entrypoints.bench.serve_structured import structured_fields

SCHEMA: dict[str, Any] = structured_fields("json-schema")["response_format"]["json_schema"][
    "schema"]
LLAMA_3_8B = Path(__file__).resolve().parent / "model-configs" / "llama-3-8b.json"
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
    "bos_token_id": 1022, "eos_token_id": 1023, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
PREFILL_STEPS = 2
"""Steps of a batch-1 request not timed: its prefill and the step that overlaps it."""


@dataclass(frozen=True)
class Workload:
    batch: int = 64
    input_len: int = 256
    output_len: int = 256
    repeats: int = 3
    temperature: float = 1.0
    step_samples: int = 200
    load: int = 64
    load_tokens: int = 1024


TINY = Workload(batch=4, input_len=16, output_len=24, repeats=1, step_samples=12, load=4,
                load_tokens=96)


# -- the workloads ---------------------------------------------------------------------------

def constrained(max_tokens: int, temperature: float, schema: dict[str, Any]) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature,
                          structured_outputs=StructuredOutputsParams(json=schema))


def free(max_tokens: int, temperature: float) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)


def timed_generate(llm: LLM, prompts: list, params: Any) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def throughput_pair(llm: LLM, prompts: list, w: Workload, tokenizer: Any) -> dict[str, Any]:
    """One constrained run, then the free run with the same tokens per prompt."""
    t_con, outputs = timed_generate(llm, prompts, constrained(w.output_len, w.temperature,
                                                              SCHEMA))
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    t_free, _ = timed_generate(llm, prompts, [free(n, w.temperature) for n in lengths])
    ended = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
    tokens = sum(lengths)
    return {
        "constrained_tok_per_s": tokens / t_con, "unconstrained_tok_per_s": tokens / t_free,
        "ratio": t_free / t_con, "mean_output_tokens": tokens / len(prompts),
        "ended_by_grammar": len(ended), "valid_json": sum(map(is_json, (
            tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in ended))),
    }


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def throughput(llm: LLM, w: Workload, tokenizer: Any) -> dict[str, Any]:
    prompts = random_prompts(np.random.default_rng(0), [w.input_len] * w.batch,
                             llm.engine_core.vocab_size)
    llm.generate(prompts, constrained(4, w.temperature, SCHEMA), use_tqdm=False)  # compile
    llm.generate(prompts, free(4, w.temperature), use_tqdm=False)
    pairs = [throughput_pair(llm, prompts, w, tokenizer) for _ in range(w.repeats)]
    median = statistics.median(p["ratio"] for p in pairs)
    return {"batch": w.batch, "max_output_tokens": w.output_len, "median_ratio": median,
            "target_ratio": 0.9, "pairs": pairs}


def step_times(llm: LLM, prompt: dict, params: SamplingParams, samples: int) -> list[float]:
    """Wall time (s) of each ``step()`` of one request past its prefill, request after
    request until ``samples`` were taken."""
    times: list[float] = []
    while len(times) < samples:
        llm.add_request(prompt, params)
        mine = []
        while llm.has_unfinished_requests():
            start = time.perf_counter()
            llm.step()
            mine.append(time.perf_counter() - start)
        times += mine[PREFILL_STEPS:]
    return times[:samples]


def batch1_step(llm: LLM, w: Workload) -> dict[str, Any]:
    prompt = random_prompts(np.random.default_rng(1), [w.input_len], llm.engine_core.vocab_size)[0]
    kinds = {"unconstrained": free(w.step_samples + PREFILL_STEPS, w.temperature),
             "constrained": constrained(w.step_samples + PREFILL_STEPS, w.temperature, SCHEMA)}
    for params in kinds.values():  # warm-up (and the schema is compiled by now)
        step_times(llm, prompt, params, 4)
    ms = {name: 1e3 * statistics.median(step_times(llm, prompt, params, w.step_samples))
          for name, params in kinds.items()}
    return {"unconstrained_step_ms": ms["unconstrained"], "constrained_step_ms": ms["constrained"],
            "extra_ms": ms["constrained"] - ms["unconstrained"], "target_extra_ms": 0.3}


def new_schema() -> dict[str, Any]:
    """The ten-field schema with one more field whose name no earlier request used."""
    schema = copy.deepcopy(SCHEMA)
    name = f"field_{time.time_ns()}"
    schema["properties"][name] = {"type": "string"}
    schema["required"].append(name)
    return schema


def first_token_ms(llm: LLM, prompt: dict, params: SamplingParams) -> tuple[float, int]:
    """Milliseconds until a one-token request is done, stepping the engine; and how many other
    requests finished meanwhile."""
    start = time.perf_counter()
    request_id = llm.add_request(prompt, params)
    others = 0
    while True:
        done = llm.step()
        others += sum(o.request_id != request_id for o in done)
        if any(o.request_id == request_id for o in done):
            return 1e3 * (time.perf_counter() - start), others


def first_token_under_load(llm: LLM, w: Workload) -> dict[str, Any]:
    rng = np.random.default_rng(2)
    vocab = llm.engine_core.vocab_size
    load, probes = (random_prompts(rng, [w.input_len] * n, vocab) for n in (w.load, 3))
    llm.generate(probes[1], constrained(1, w.temperature, SCHEMA), use_tqdm=False)  # cached
    for prompt in load:
        llm.add_request(prompt, free(w.load_tokens, w.temperature))
    budget = llm.engine_core.config.scheduler.max_num_batched_tokens
    for _ in range(-(-w.load * w.input_len // budget) + PREFILL_STEPS):  # the load's prefills
        llm.step()
    kinds = {"unconstrained": free(1, w.temperature),
             "cached_schema": constrained(1, w.temperature, SCHEMA),
             "new_schema": constrained(1, w.temperature, new_schema())}
    result: dict[str, Any] = {"running": w.load, "load_finished_meanwhile": 0}
    for (name, params), prompt in zip(kinds.items(), probes, strict=True):
        ms, others = first_token_ms(llm, prompt, params)
        result[f"{name}_ttft_ms"] = ms
        result["load_finished_meanwhile"] += others
    while llm.has_unfinished_requests():
        llm.step()
    return result


def run(llm: LLM, model_dir: Path, w: Workload = Workload()) -> dict[str, Any]:
    """The three figures on an engine that is up; writes the synthetic tokenizer into
    ``model_dir`` (the engine's model folder) first unless it has one."""
    tokenizer = synthetic_tokenizer(model_dir)
    result = {"workload": asdict(w), "throughput": throughput(llm, w, tokenizer),
              "batch1": batch1_step(llm, w), "ttft": first_token_under_load(llm, w)}
    print(report(result))
    return result


def report(result: dict[str, Any]) -> str:
    t, b, f = result["throughput"], result["batch1"], result["ttft"]
    last = t["pairs"][-1]
    return "\n".join([
        f"batch {t['batch']}, JSON schema of ten fields, up to {t['max_output_tokens']} tokens "
        f"(mean {last['mean_output_tokens']:.0f}; {last['ended_by_grammar']} ended by the "
        f"grammar, {last['valid_json']} of them valid JSON):",
        *(f"  constrained {p['constrained_tok_per_s']:9.0f} tok/s   unconstrained "
          f"{p['unconstrained_tok_per_s']:9.0f} tok/s   ratio {p['ratio']:.3f}"
          for p in t["pairs"]),
        f"  median ratio {t['median_ratio']:.3f} (target >= {t['target_ratio']})",
        f"batch-1 decode step: constrained {b['constrained_step_ms']:.3f} ms   unconstrained "
        f"{b['unconstrained_step_ms']:.3f} ms   {b['extra_ms']:+.3f} ms "
        f"(target <= +{b['target_extra_ms']})",
        f"time to first token with {f['running']} running: unconstrained "
        f"{f['unconstrained_ttft_ms']:.1f} ms   cached schema {f['cached_schema_ttft_ms']:.1f} "
        f"ms   new schema {f['new_schema_ttft_ms']:.1f} ms"
        f" ({f['load_finished_meanwhile']} of the load finished meanwhile)",
    ])


# -- the synthetic tokenizer -----------------------------------------------------------------

LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
PUNCTUATION = "\"{}[]():;,.'_-=+*/<>!?#\\"


def synthetic_words(rng: random.Random) -> Iterator[str]:
    """Endless word-like strings in the byte-level alphabet (``Ġ`` is a space): mostly
    lower-case words, some capitalised, numbers and punctuation runs (quotes among them)."""
    weights = [1 / (i + 1) ** 0.5 for i in range(len(LETTERS))]
    while True:
        roll = rng.random()
        space = "Ġ" if rng.random() < 0.6 else ""
        if roll < 0.85:
            text = "".join(rng.choices(LETTERS, weights, k=rng.randint(2, 10)))
            yield space + (text.capitalize() if rng.random() < 0.15 else text)
        elif roll < 0.93:
            yield space + "".join(rng.choices("0123456789", k=rng.randint(1, 3)))
        else:
            yield space + "".join(rng.choices(PUNCTUATION, k=rng.randint(1, 3)))


def synthetic_bpe(num_regular: int, seed: int = 0) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary of ``num_regular`` tokens: the 256 byte symbols, then every
    prefix of generated words, each one merge (prefix, next symbol) away from a shorter one."""
    from tokenizers import pre_tokenizers

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges: list[tuple[str, str]] = []
    for word in synthetic_words(random.Random(seed)):
        for end in range(2, len(word) + 1):
            if len(vocab) == num_regular:
                return vocab, merges
            if word[:end] not in vocab:
                vocab[word[:end]] = len(vocab)
                merges.append((word[: end - 1], word[end - 1]))
    raise AssertionError("unreachable: the words never end")


def synthetic_tokenizer(model_dir: Path) -> Any:
    """Write a tokenizer for the model's vocabulary size into ``model_dir`` (unless there is
    one) and return it loaded. Ids from the config's smallest BOS/EOS id up are special
    tokens (Llama 3's 256 reserved ones), EOS and BOS among them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if not (model_dir / "tokenizer.json").exists():
        config = json.loads((model_dir / "config.json").read_text())
        bos, eos, size = config["bos_token_id"], config["eos_token_id"], config["vocab_size"]
        first_special = min(bos, eos)
        vocab, merges = synthetic_bpe(first_special)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        names = {bos: "<|begin_of_text|>", eos: "<|end_of_text|>"}
        tok.add_special_tokens([names.get(i, f"<|reserved_special_token_{i}|>")
                                for i in range(first_special, size)])
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=names[bos],
                                eos_token=names[eos]).save_pretrained(model_dir)
    return AutoTokenizer.from_pretrained(model_dir)


# -- standalone --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Preset:
    config: dict[str, Any]
    engine: dict[str, Any]
    """``LLM`` options besides the model folder and dummy weights."""
    workload: Workload = field(default_factory=Workload)


PRESETS = {
    "llama-3-8b": Preset(json.loads(LLAMA_3_8B.read_text()),
                         {"dtype": "bfloat16", "gpu_memory_utilization": 0.6,
                          "max_num_seqs": 256}),
    "tiny": Preset(TINY_CONFIG, {"dtype": "float32", "device": "cpu",
                                 "max_num_batched_tokens": 256, "max_num_seqs": 16}, TINY),
}
"""``llama-3-8b``: the suite's 8B engine (a CUDA machine); ``tiny``: a CPU smoke test."""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".", help="appends one JSON line to structured.json")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-3-8b")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(tempfile.mkdtemp())
    (model_dir / "config.json").write_text(json.dumps(preset.config))
    llm = LLM(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
              **preset.engine)
    result = run(llm, model_dir, preset.workload)
    with open(out / "structured.json", "a") as f:
        f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
