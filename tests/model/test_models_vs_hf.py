"""Our models against transformers on tiny random checkpoints (fp32).

For each architecture: logits of every prompt position and every decode position match
within 1e-4, and 32 greedy steps through the paged KV cache give transformers' tokens —
once with whole-prompt prefill plus padding rows, once with chunked prefill (cached prefixes,
prefill and decode rows in one batch).
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.model.registry import get_model_class
from tests.model.hf_tiny import CASES, make_hf_model, saved_checkpoint
from tests.model.paged_harness import greedy_generate

NUM_STEPS = 32
PROMPT_LENS = (7, 13, 2)


def _prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _hf_greedy(hf_model, prompt: list[int]) -> list[int]:
    input_ids = torch.tensor([prompt])
    out = hf_model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=NUM_STEPS,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def _hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([token_ids])).logits[0].float()  # [len, vocab]


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(case: str, tmp_path) -> None:
    torch.set_num_threads(1)
    hf_model = make_hf_model(case)
    config = hf_model.config
    ours = get_model_class(config)(config, torch.float32, torch.device("cpu"))
    loaded = ours.load_weights(saved_checkpoint(hf_model, tmp_path).items())
    assert loaded == {name for name, _ in ours.named_parameters()}

    prompts = _prompts(config.vocab_size)
    expected = [_hf_greedy(hf_model, p) for p in prompts]
    assert all(len(tokens) == NUM_STEPS for tokens in expected)
    assert len({t for tokens in expected for t in tokens}) > 4, "degenerate reference output"

    for chunk, padding in ((None, 3), (4, 0)):
        seqs = greedy_generate(ours, prompts, NUM_STEPS, prefill_chunk=chunk, num_padding=padding)
        for seq, prompt, want in zip(seqs, prompts, expected, strict=True):
            assert seq.generated == want, f"{case} chunk={chunk}: greedy tokens differ"
            # Logits of every computed position: the prompt and all but the last generated token.
            hf_logits = _hf_logits(hf_model, prompt + want[:-1])
            torch.testing.assert_close(torch.stack(seq.logits), hf_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_bf16_stays_close_to_fp32(case: str) -> None:
    """bf16 (the CPU/GPU default) runs the same path; prompt logits within bf16 rounding.

    Logits here reach about 3; bf16 keeps 8 bits of mantissa (steps of 1/64 near 3), and two
    layers of rounding measured about 0.05 off fp32, so 0.15 leaves a 3x margin.
    """
    torch.set_num_threads(1)
    hf_model = make_hf_model(case)
    config, weights = hf_model.config, hf_model.state_dict()
    prompts = _prompts(config.vocab_size)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = get_model_class(config)(config, dtype, torch.device("cpu"))
        model.load_weights(weights.items())
        seqs = greedy_generate(model, prompts, num_steps=1, prefill_chunk=5)
        logits[dtype] = torch.cat([torch.stack(s.logits[: s.prompt_len]) for s in seqs])
    torch.testing.assert_close(logits[torch.bfloat16], logits[torch.float32], atol=0.15, rtol=0)
