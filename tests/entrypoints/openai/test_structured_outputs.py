"""Structured outputs through the official ``openai`` client against a real server (the tiny
random Llama): ``response_format``, ``structured_outputs``, the ``guided_*`` aliases, a 400
naming the field for a bad spec, and the grammar metrics."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.entrypoints.openai.server_utils import API_KEY, REPO_ROOT, ServerProcess

MESSAGES = [{"role": "user", "content": "Describe a point."}]
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                   "label": {"type": "string", "maxLength": 4}},
    "required": ["x", "label"],
    "additionalProperties": False,
}


class Point(BaseModel):
    x: int = Field(ge=0, le=9)
    label: str = Field(max_length=4)


def _json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "point", "schema": schema,
                                                    "strict": True}}


def test_chat_response_format_json_schema(client: openai.OpenAI, model_name: str) -> None:
    response = client.chat.completions.create(
        model=model_name, messages=MESSAGES, temperature=1.0, seed=3, n=2, max_tokens=64,
        response_format=_json_schema_format(POINT))  # type: ignore[arg-type]
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), POINT)


def test_chat_parse_with_a_pydantic_model(client: openai.OpenAI, model_name: str) -> None:
    completion = client.beta.chat.completions.parse(
        model=model_name, messages=MESSAGES, temperature=0.0, max_tokens=64,
        response_format=Point)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Point) and 0 <= parsed.x <= 9


def test_chat_json_object_streamed(client: openai.OpenAI, model_name: str) -> None:
    stream = client.chat.completions.create(
        model=model_name, messages=MESSAGES, temperature=0.0, max_tokens=128, stream=True,
        response_format={"type": "json_object"})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    ("extra_body", "check"),
    [
        ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
        ({"guided_regex": r"[a-c]{3}\d"}, lambda t: re.fullmatch(r"[a-c]{3}\d", t)),
        ({"guided_json": POINT}, lambda t: jsonschema.validate(json.loads(t), POINT) is None),
        ({"guided_grammar": 'root ::= "x" [0-9] | "y"'}, lambda t: re.fullmatch(r"x\d|y", t)),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"response_format": {"type": "json_object"}}, lambda t: json.loads(t) is not None),
    ],
)
def test_completions_fields_and_aliases(
    client: openai.OpenAI, model_name: str, extra_body: dict, check
) -> None:
    response = client.completions.create(
        model=model_name, prompt="The answer:", temperature=1.0, seed=1, max_tokens=128,
        extra_body=extra_body)
    text = response.choices[0].text
    assert response.choices[0].finish_reason == "stop" and check(text), text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": _json_schema_format({"type": "bogus"})},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"guided_regex": "a("}, "guided_regex"),
        ({"guided_grammar": "root ::= nothing"}, "guided_grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
        ({"response_format": {"type": "structural_tag", "triggers": ["<"]}}, "response_format"),
        ({"response_format": {"type": "structural_tag", "triggers": ["<b"], "structures": [
            {"begin": "<a>", "schema": {}, "end": "</a>"}]}}, "response_format"),
        ({"structured_outputs": {"structural_tag": "{"}}, "structured_outputs.structural_tag"),
    ],
)
def test_bad_specs_are_a_400_naming_the_field(
    server: ServerProcess, model_name: str, body: dict, param: str
) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"model": model_name, "messages": MESSAGES, "max_tokens": 4, **body},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_structural_tag_response_format(client: openai.OpenAI, model_name: str) -> None:
    """vLLM's ``response_format: {"type": "structural_tag"}``: free text, and after the trigger
    (``<``, pushed up by logit_bias so that the random model writes it) the structure: its
    begin, an object of its schema, its end."""
    tag = {"type": "structural_tag", "triggers": ["<"], "structures": [
        {"begin": "<f=w>", "end": "</f>", "schema": {
            "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"], "additionalProperties": False}}]}
    bias = {"30": 100}  # "<" in the tiny byte-level vocabulary
    response = client.chat.completions.create(
        model=model_name, messages=MESSAGES, temperature=0.0, max_completion_tokens=40,
        logit_bias=bias, extra_body={"response_format": tag})
    text = response.choices[0].message.content
    assert re.search(r'<f=w>\{\s?"city"\s?:\s?"(Paris|Rome)"\s?\}</f>', text), text


def test_grammar_metrics(client: openai.OpenAI, server: ServerProcess, model_name: str) -> None:
    for _ in range(2):
        client.completions.create(model=model_name, prompt="Pick:", max_tokens=8,
                                  extra_body={"guided_choice": ["metric", "cache"]})
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"},
                     timeout=30).text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line.startswith("pagedserve:grammar_")}
    assert values["pagedserve:grammar_compiles_total"] >= 1
    assert values["pagedserve:grammar_cache_hits_total"] >= 1
    assert values["pagedserve:grammar_compile_seconds_total"] > 0


def test_bench_serve_structured(server: ServerProcess, tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "serve",
        "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "4",
        "--input-len", "6", "--output-len", "24", "--structured", "json-schema",
        "--disable-tqdm", "--result-dir", str(tmp_path), "--result-filename", "run.json",
    ]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads((tmp_path / "run.json").read_text())
    assert result["structured"] == "json-schema"
    assert result["completed"] == 4 and result["failed"] == 0
