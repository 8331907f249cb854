"""StructuredOutputsParams: exactly one kind, each spec parsed up front, errors name the field."""

from __future__ import annotations

import pytest

import pagedserve
from pagedserve import SamplingParams, StructuredOutputsParams
from pagedserve import sampling_params as sampling_params_module


def test_importable_as_in_vllm():
    assert pagedserve.StructuredOutputsParams is sampling_params_module.StructuredOutputsParams


@pytest.mark.parametrize(
    ("kwargs", "kind"),
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}, "json"),
        ({"json": '{"type": "array", "items": {"type": "string"}}'}, "json"),
        ({"regex": r"\d{3}-[a-z]+"}, "regex"),
        ({"choice": ["yes", "no"]}, "choice"),
        ({"grammar": 'root ::= "a" root | "b"'}, "grammar"),
        ({"json_object": True}, "json_object"),
        ({"structural_tag": {"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}],
                             "triggers": ["<a"]}}, "structural_tag"),
    ],
)
def test_each_kind_is_accepted(kwargs, kind):
    params = StructuredOutputsParams(**kwargs)
    assert params.kind == kind and params.key == (kind, params.source)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "structured_outputs: set exactly one of"),
        ({"json": {"type": "object"}, "regex": "a"}, "got json, regex"),
        ({"json_object": False}, "got none"),
        ({"json": {"type": "bogus"}}, 'structured_outputs.json: Unsupported type "bogus"'),
        ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
        ({"json": [1, 2]}, "structured_outputs.json: expected a JSON schema object"),
        ({"regex": "a("}, "structured_outputs.regex: Regex parsing error"),
        ({"regex": ""}, "structured_outputs.regex: expected a non-empty string"),
        ({"grammar": "root ::= missing"}, 'structured_outputs.grammar: EBNF parser error'),
        ({"choice": []}, "structured_outputs.choice: expected a non-empty list"),
        ({"choice": ["a", 3]}, "structured_outputs.choice: expected a non-empty list"),
        ({"json_object": "yes"}, "structured_outputs.json_object: expected true"),
        ({"structural_tag": "{"}, "structured_outputs.structural_tag: not valid JSON"),
        ({"structural_tag": {"structures": [], "triggers": ["<"]}},
         "structured_outputs.structural_tag: structures: expected a non-empty list"),
        ({"structural_tag": {"structures": [{"begin": "<a>", "schema": {}, "end": ""}],
                             "triggers": ["<b"]}},
         "structured_outputs.structural_tag: .*does not match any trigger"),
    ],
)
def test_bad_specs_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_takes_params_or_a_dict():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    assert params.clone().structured_outputs is params.structured_outputs
    with pytest.raises(ValueError, match="structured_outputs: expected StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        SamplingParams(structured_outputs={"regex": "("})
    with pytest.raises(ValueError, match="min_tokens: not supported with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs={"choice": ["a"]})


def test_schema_keeps_its_property_order():
    schema = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}}
    assert StructuredOutputsParams(json=schema).source.index('"z"') < \
        StructuredOutputsParams(json=schema).source.index('"a"')


def test_length_bounded_strings_compile_as_plain_character_patterns():
    """xgrammar's own length bounds admit raw control characters; the compiled schema's
    pattern does not (quotes, backslashes and control characters are left out)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}}
    source = StructuredOutputsParams(json=schema).source
    assert '"pattern": "^[^\\"\\\\\\\\\\\\x00-\\\\x1f]{0,3}$"' in source
    assert "maxLength" not in source
