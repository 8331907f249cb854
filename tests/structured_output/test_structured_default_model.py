"""Structured outputs with the default model (SmolLM2-135M-Instruct): a real model's JSON for
a schema with nested objects, arrays, enums, bounded numbers, ``$defs`` and ``anyOf``, greedy
and sampled with n = 4, under preemption and chunked prefill. One engine: loading costs
seconds."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams, StructuredOutputsParams

PERSON = {
    "$defs": {
        "pet": {"type": "object",
                "properties": {"kind": {"enum": ["cat", "dog", "fish"]},
                               "age": {"type": "integer", "minimum": 0, "maximum": 30}},
                "required": ["kind", "age"], "additionalProperties": False},
    },
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "contact": {"anyOf": [{"type": "string", "maxLength": 32}, {"type": "null"}]},
        "pets": {"type": "array", "items": {"$ref": "#/$defs/pet"}, "maxItems": 2},
    },
    "required": ["name", "height_m", "contact", "pets"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person and their pets as JSON."}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    # 24 blocks of 16 tokens for five requests of ~110 tokens, admitted whenever the prompt
    # fits: some are preempted; a 64-token budget chunks the prompts.
    return LLM(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8,
               num_gpu_blocks_override=24, enable_chunked_prefill=True,
               admission_policy="greedy")


def test_default_model_answers_validate(llm: LLM) -> None:
    constraint = StructuredOutputsParams(json=PERSON)
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=constraint),
              SamplingParams(temperature=0.8, seed=2, n=4, max_tokens=120,
                             structured_outputs=constraint)]
    outputs = llm.chat([MESSAGES, MESSAGES], params, use_tqdm=False)
    completions = [c for o in outputs for c in o.outputs]
    assert len(completions) == 5
    for completion in completions:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), PERSON)
    assert llm.engine_core.get_stats().num_preemptions > 0


def test_default_model_choice(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]
    params = SamplingParams(temperature=0.0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    (output,) = llm.chat([messages], params, use_tqdm=False)
    assert output.outputs[0].text == "yes"
