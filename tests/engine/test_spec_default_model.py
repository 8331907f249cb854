"""The acceptance rate of ngram drafts on the default model (SmolLM2-135M-Instruct GGUF) with
a prompt that contains the text its output repeats (a code edit). Reported, and it must be
above 0. One engine, few tokens: loading the model costs most of the time."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams

CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    return subtotal * (1 + tax_rate)
"""
PROMPT = "# Original:\n" + CODE + "\n# Copy:\ndef total_price("


def test_ngram_acceptance_rate_on_the_default_model(record_property: pytest.RecordProperty):
    llm = LLM(max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    (output,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24),
                             use_tqdm=False)
    stats = llm.engine_core.get_stats()
    rate = stats.spec_decode_acceptance_rate
    record_property("spec_decode_acceptance_rate", rate)
    record_property("spec_decode_accepted_per_position", stats.spec_decode_accepted_per_position)
    print(f"ngram k=4 on {llm.config.model.model}: {stats.spec_decode_num_accepted_tokens} of "
          f"{stats.spec_decode_num_draft_tokens} drafts accepted ({rate:.2f}), per position "
          f"{stats.spec_decode_accepted_per_position}, {len(output.outputs[0].token_ids)} tokens")
    assert rate > 0
    assert stats.generation_tokens == len(output.outputs[0].token_ids)
