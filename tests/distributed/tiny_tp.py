"""Tiny random Llama and Qwen2 checkpoints for tensor-parallel tests, and the comparison of
two engines' outputs.

The shapes make TP=2 exercise every split: a vocabulary (250) that is not a multiple of
64 * 2 (the last rank's slice ends in padding), one KV head for Llama (replicated on both
ranks) and two for Qwen2 (split), an untied LM head (Llama) and a tied one (Qwen2), and
Qwen2's q/k/v biases.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from pagedserve import SamplingParams
from pagedserve.outputs import RequestOutput

ARCHS = ("llama", "qwen2")
VOCAB_SIZE = 250
LOGPROB_ATOL = 1e-4

COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    initializer_range=0.1,  # wide logits: no near-ties for greedy decoding to trip on
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

ENGINE_ARGS = dict(
    dtype="float32",
    max_num_batched_tokens=32,  # the 40-token prompt is prefilled in two chunks
    max_num_seqs=4,
    num_gpu_blocks_override=48,
    skip_tokenizer_init=True,
)

PROMPTS = [
    [5, 9, 33, 100, 7],
    [(17 * i) % (VOCAB_SIZE - 3) + 3 for i in range(40)],
    [249, 248, 200, 130, 64, 63, 1, 2, 3, 190, 191, 192, 240, 241, 242, 3, 4],
]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2),
    # Unseeded sampling: every rank must draw the same token, or the ranks' next inputs differ.
    SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True),
]


def save_checkpoint(arch: str, folder: Path) -> Path:
    if arch == "llama":
        config = LlamaConfig(**COMMON, num_key_value_heads=1, tie_word_embeddings=False)
        model_cls = LlamaForCausalLM
    elif arch == "qwen2":
        config = Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True)
        model_cls = Qwen2ForCausalLM
    else:
        raise ValueError(f"arch: unknown tiny architecture {arch!r}")
    config.architectures = [model_cls.__name__]
    torch.manual_seed(0)
    model_cls(config).eval().save_pretrained(folder)
    return folder


def generate(llm) -> list[RequestOutput]:  # noqa: ANN001
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)


def _assert_logprobs_close(ours: list | None, ref: list | None, what: str) -> None:
    assert (ours is None) == (ref is None), what
    if ref is None:
        return
    assert len(ours) == len(ref), what
    for pos, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert (a is None) == (b is None), f"{what}[{pos}]"
        if b is None:
            continue
        assert set(a) == set(b), f"{what}[{pos}]: top tokens {sorted(a)} != {sorted(b)}"
        for token, lp in b.items():
            assert abs(a[token].logprob - lp.logprob) <= LOGPROB_ATOL, (
                f"{what}[{pos}] token {token}: {a[token].logprob} vs {lp.logprob}"
            )


def assert_same_outputs(ours: list[RequestOutput], ref: list[RequestOutput]) -> None:
    """Exactly the same tokens; logprobs (sampled and prompt) within LOGPROB_ATOL."""
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"request {i}"
        _assert_logprobs_close(
            a.outputs[0].logprobs, b.outputs[0].logprobs, f"request {i} logprobs"
        )
        _assert_logprobs_close(a.prompt_logprobs, b.prompt_logprobs, f"request {i} prompt_logprobs")


def generate_until_killed(llm, kill: Callable[[], None]) -> tuple[BaseException, float]:  # noqa: ANN001
    """Stream a long generation and call ``kill`` (from another thread, so it lands while a
    step runs) once tokens flow. Returns the engine's exception and the seconds from the kill
    to the exception."""
    stream = llm.stream(
        {"prompt_token_ids": PROMPTS[0]},
        SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
    )
    killed_at = 0.0
    try:
        for i, _ in enumerate(stream):
            if i == 2:
                threading.Timer(0.005, kill).start()
                killed_at = time.monotonic()
    except Exception as e:  # the engine's error, the object of the test
        return e, time.monotonic() - killed_at
    raise AssertionError("generation finished although a worker was killed")
