"""Structured outputs end to end through ``LLM.generate`` on the tiny random Llama: every
answer obeys its constraint, greedy and sampled, with n = 4, under preemption, chunked
prefill, prefix caching and asynchronous scheduling; unconstrained neighbours are unchanged."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams, StructuredOutputsParams

PROMPTS = ["The quick brown fox", "Paris is the capital of", "Hello world! This is"]
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 5},
                               "active": {"type": "boolean"}},
                "required": ["name", "active"],
                "additionalProperties": False,
            },
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                       "minItems": 1, "maxItems": 3},
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                       "level": {"type": "integer", "minimum": -3, "maximum": 3}},
        "required": ["age", "level"],
        "additionalProperties": False,
    },
    "defs_refs": {
        "$defs": {"point": {"type": "object",
                            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 500},
                                        {"type": "string", "maxLength": 4}]},
                       "kind": {"const": "item"}},
        "required": ["id", "kind"],
        "additionalProperties": False,
    },
}
ARITHMETIC = """
root ::= expr
expr ::= term | term op term | term op term op term
term ::= num | "(" num op num ")"
num ::= [1-9] | [1-9] [0-9]
op ::= "+" | "-" | "*"
"""
"""Bounded (a random model would nest an unbounded grammar until max_tokens)."""
ARITHMETIC_RE = re.compile(r"[0-9+\-*()]+")


@pytest.fixture(scope="module")
def llm(tiny_llama):
    folder, _, _ = tiny_llama
    return LLM(str(folder), dtype="float32", max_num_batched_tokens=128,
               num_gpu_blocks_override=128)


def _params(constraint: StructuredOutputsParams, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 96)
    return SamplingParams(structured_outputs=constraint, **kwargs)


def _greedy_and_sampled(constraint: StructuredOutputsParams) -> list[SamplingParams]:
    return [_params(constraint, temperature=0.0),
            _params(constraint, temperature=1.0, n=4, seed=5)]


def _texts(outputs) -> list[str]:
    texts = []
    for output in outputs:
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion
            texts.append(completion.text)
    return texts


def _assert_valid(texts: list[str], schema: dict) -> None:
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_answers_validate(llm, name):
    schema = SCHEMAS[name]
    constraint = StructuredOutputsParams(json=schema)
    params = _greedy_and_sampled(constraint)
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    texts = _texts(outputs)
    assert len(texts) == 5
    _assert_valid(texts, schema)


def test_json_object_is_an_object(llm):
    params = _params(StructuredOutputsParams(json_object=True), temperature=0.0, max_tokens=128)
    (text,) = _texts(llm.generate(["Hello"], params, use_tqdm=False))
    assert isinstance(json.loads(text), dict)


def test_choice_returns_one_of_the_choices(llm):
    choices = ["yes", "no", "the capital"]
    params = _greedy_and_sampled(StructuredOutputsParams(choice=choices))
    texts = _texts(llm.generate(PROMPTS[:2], params, use_tqdm=False))
    assert len(texts) == 5 and set(texts) <= set(choices)


def test_regex_answers_match(llm):
    pattern = r"[a-z]{2,4}-\d{2}(\.[A-Z])?"
    params = _greedy_and_sampled(StructuredOutputsParams(regex=pattern))
    for text in _texts(llm.generate(PROMPTS[:2], params, use_tqdm=False)):
        assert re.fullmatch(pattern, text), text


def test_ebnf_arithmetic_grammar_is_obeyed(llm):
    params = _greedy_and_sampled(StructuredOutputsParams(grammar=ARITHMETIC))
    for text in _texts(llm.generate(PROMPTS[:2], params, use_tqdm=False)):
        assert ARITHMETIC_RE.fullmatch(text) and text.count("(") == text.count(")"), text
        eval(compile(text, "<answer>", "eval"), {"__builtins__": {}})  # parses as arithmetic


def test_unconstrained_tokens_unchanged_by_a_constrained_neighbour(llm):
    free = SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
    (alone,) = llm.generate([PROMPTS[2]], free, use_tqdm=False)
    constrained = _params(StructuredOutputsParams(json=SCHEMAS["nested"]), temperature=1.0,
                          seed=3)
    together = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]],
                            [constrained, free, constrained], use_tqdm=False)
    assert together[1].outputs[0].token_ids == alone.outputs[0].token_ids
    _assert_valid(_texts([together[0], together[2]]), SCHEMAS["nested"])


def test_grammars_are_cached_by_key(llm):
    core = llm.engine_core
    schema = {"type": "object", "properties": {"k": {"enum": ["cache", "me"]}},
              "required": ["k"], "additionalProperties": False}
    before = core.get_stats()
    params = _params(StructuredOutputsParams(json=schema), temperature=1.0, n=3, seed=1)
    _texts(llm.generate(PROMPTS[:2], params, use_tqdm=False))
    after = core.get_stats()
    assert after.grammar_compiles - before.grammar_compiles == 1
    assert after.grammar_cache_queries - before.grammar_cache_queries == 6
    assert after.grammar_cache_hits - before.grammar_cache_hits == 5
    assert after.grammar_compile_seconds > before.grammar_compile_seconds
    assert core.scheduler.num_constrained_requests == 0  # every constrained request finished


def _run_stressed(llm: LLM) -> list[str]:
    schema = SCHEMAS["defs_refs"]
    prompt = " ".join(PROMPTS * 4)  # several blocks long: chunked, and shared by prefix cache
    params = _params(StructuredOutputsParams(json=schema), temperature=1.0, n=4, seed=9)
    texts = _texts(llm.generate([prompt, prompt + " again"], params, use_tqdm=False))
    _assert_valid(texts, schema)
    return texts


def test_under_preemption_chunked_prefill_and_prefix_caching(tiny_llama):
    folder, _, _ = tiny_llama
    # 14 blocks of 16 tokens for 8 requests of ~70 tokens: they cannot all run at once.
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=32, max_model_len=192,
              num_gpu_blocks_override=14, enable_chunked_prefill=True)
    _run_stressed(llm)
    stats = llm.engine_core.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_async_scheduling_gives_the_synchronous_tokens(tiny_llama, llm):
    """The step after a constrained one waits for its tokens before it samples: the tokens
    are those of synchronous scheduling."""
    folder, _, _ = tiny_llama
    async_llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=128,
                    num_gpu_blocks_override=128, async_scheduling=True)
    constrained = _params(StructuredOutputsParams(json=SCHEMAS["array_enum"]), temperature=1.0,
                          n=2, seed=21)
    free = SamplingParams(temperature=1.0, seed=4, max_tokens=30, ignore_eos=True)
    params = [constrained, free, constrained]

    def tokens(engine: LLM) -> list[list[int]]:
        outputs = engine.generate(PROMPTS, params, use_tqdm=False)
        return [list(c.token_ids) for o in outputs for c in o.outputs]

    assert tokens(async_llm) == tokens(llm)


def test_tensor_parallel_masks_every_rank_alike(tiny_llama, llm):
    """TP=2 (worker processes, gloo): the core fills the mask and sends it with the plan;
    with async scheduling a constrained step waits for the step before it. The tokens are
    those of the in-process engine."""
    folder, _, _ = tiny_llama
    tp2 = LLM(str(folder), dtype="float32", max_num_batched_tokens=128,
              num_gpu_blocks_override=128, tensor_parallel_size=2, async_scheduling=True)
    try:
        constrained = _params(StructuredOutputsParams(json=SCHEMAS["bounded_numbers"]),
                              temperature=1.0, n=2, seed=8)
        free = SamplingParams(temperature=1.0, seed=6, max_tokens=20, ignore_eos=True)
        outputs = {}
        for name, engine in (("tp2", tp2), ("tp1", llm)):
            results = engine.generate(PROMPTS[:2], [constrained, free], use_tqdm=False)
            outputs[name] = [list(c.token_ids) for o in results for c in o.outputs]
        assert outputs["tp2"] == outputs["tp1"]
    finally:
        tp2.engine_core.shutdown()


TAG = {"structures": [{"begin": "<f=w>", "end": "</f>", "schema": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}], "triggers": ["<"]}
"""Free text until ``<``; then ``<f=w>``, an object of that schema, ``</f>``."""
TAG_RE = re.compile(r'<f=w>\{\s?"city"\s?:\s?"(Paris|Rome)"\s?\}</f>')
"""At most one whitespace character in a row inside a structure's JSON."""


def test_structural_tag_constrains_what_follows_a_trigger(llm, tiny_llama):
    """The trigger ``<`` is pushed up by logit_bias, so the random model writes it at once;
    from there the structure is forced (the mask wins over the bias)."""
    _, _, tokenizer = tiny_llama
    bias = dict.fromkeys(tokenizer.encode("<"), 100.0)
    params = _params(StructuredOutputsParams(structural_tag=json.dumps(TAG)), temperature=0.0,
                     max_tokens=40, logit_bias=bias)
    (output,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    text = output.outputs[0].text
    assert TAG_RE.match(text), text
    # Every trigger (a "<" not of an end) opens a whole structure; the last may be cut short.
    for start in (m.start() for m in re.finditer("<(?!/f>)", text)):
        rest = text[start:]
        assert TAG_RE.match(rest) or len(rest) < 30, text
    unconstrained = llm.generate(PROMPTS[0], _params(None, temperature=0.0, max_tokens=40,
                                                     logit_bias=bias), use_tqdm=False)
    assert not TAG_RE.search(unconstrained[0].outputs[0].text)
