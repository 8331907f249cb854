"""A chat completion's text as the API returns it: reasoning (``--reasoning-parser``), content
and tool calls (``--tool-call-parser`` in ``"auto"``, the constrained shapes of ``"required"``
and named choices), whole (``ChoiceParser.parse``) or as stream deltas (``ChoiceStream``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus

from pagedserve.entrypoints.openai.errors import OpenAIError
from pagedserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningParser
from pagedserve.entrypoints.openai.responses import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from pagedserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, ParsedCalls, PartialCall
from pagedserve.entrypoints.openai.tool_parsers.base import ToolParser, default_call_id
from pagedserve.entrypoints.openai.tool_parsers.forced import (
    NamedFunctionOutput,
    RequiredCallsOutput,
)
from pagedserve.entrypoints.openai.tools_protocol import NamedToolChoice, ToolFields


@dataclass
class ParsedChoice:
    reasoning: str | None
    content: str | None
    calls: list[PartialCall] = field(default_factory=list)


class ChoiceParser:
    """Reasoning first, then tool calls in the rest; ``tools`` None: the rest is content."""

    def __init__(self, tools: ToolParser | None, reasoning: ReasoningParser | None,
                 max_calls: int | None) -> None:
        self.tools = tools
        self.reasoning = reasoning
        self.max_calls = max_calls

    @property
    def reads_plain_text(self) -> bool:
        """No parser: the text is the content, as it comes."""
        return self.tools is None and self.reasoning is None

    def parse(self, text: str) -> ParsedChoice:
        reasoning, rest = (None, text) if self.reasoning is None else self.reasoning.split(text)
        calls = ParsedCalls(rest) if self.tools is None else self.tools.parse(rest)
        return ParsedChoice(reasoning, calls.content, calls.calls[: self.max_calls])

    def parse_partial(self, text: str) -> ParsedChoice:
        reasoning, rest = ((None, text) if self.reasoning is None
                           else self.reasoning.split_partial(text))
        calls = ParsedCalls(rest) if self.tools is None else self.tools.parse_partial(rest)
        return ParsedChoice(reasoning, calls.content, calls.calls[: self.max_calls])


def tool_calls(calls: list[PartialCall], new_call_id: Callable[[], str]) -> list[ToolCall]:
    return [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name or "",
                                                             arguments=c.arguments))
            for c in calls]


def _grown(sent: str, now: str | None) -> str:
    """What ``now`` adds to the text already ``sent`` ("" when nothing, or not an extension)."""
    return now[len(sent) :] if now is not None and now.startswith(sent) else ""


class ChoiceStream:
    """One choice's deltas: the parsed text so far, less what earlier deltas sent."""

    def __init__(self, parser: ChoiceParser, new_call_id: Callable[[], str]) -> None:
        self.parser = parser
        self.new_call_id = new_call_id
        self.text = ""
        self.reasoning = ""
        self.content = ""
        self.arguments: list[str] = []
        """Per call sent: its arguments sent so far."""

    @property
    def num_calls(self) -> int:
        return len(self.arguments)

    def update(self, new_text: str) -> DeltaMessage | None:
        if self.parser.reads_plain_text:
            return DeltaMessage(content=new_text) if new_text else None
        self.text += new_text
        return self._delta(self.parser.parse_partial(self.text))

    def finish(self, new_text: str) -> DeltaMessage | None:
        """The last delta: the whole output parsed (a malformed call's text becomes content)."""
        if self.parser.reads_plain_text:
            return self.update(new_text)
        self.text += new_text
        return self._delta(self.parser.parse(self.text))

    def _delta(self, parsed: ParsedChoice) -> DeltaMessage | None:
        reasoning = _grown(self.reasoning, parsed.reasoning)
        content = _grown(self.content, parsed.content)
        self.reasoning += reasoning
        self.content += content
        calls = self._call_deltas(parsed.calls)
        if not (reasoning or content or calls):
            return None
        return DeltaMessage(reasoning_content=reasoning or None, content=content or None,
                            tool_calls=calls or None)

    def _call_deltas(self, calls: list[PartialCall]) -> list[DeltaToolCall]:
        deltas = []
        for index, call in enumerate(calls):
            if index == len(self.arguments):
                if call.name is None:
                    break
                self.arguments.append("")
                deltas.append(DeltaToolCall(index=index, id=self.new_call_id(), type="function",
                                            function=DeltaFunctionCall(name=call.name,
                                                                       arguments="")))
            arguments = _grown(self.arguments[index], call.arguments)
            if arguments:
                self.arguments[index] += arguments
                deltas.append(DeltaToolCall(index=index,
                                            function=DeltaFunctionCall(arguments=arguments)))
        return deltas


@dataclass(frozen=True)
class OutputParsing:
    """The server's ``--tool-call-parser``, ``--enable-auto-tool-choice`` and
    ``--reasoning-parser``."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice: needs --tool-call-parser")

    def new_call_id(self) -> str:
        """An id in the shape the model's chat template accepts (Mistral's: 9 characters)."""
        if self.tool_call_parser is None:
            return default_call_id()
        return TOOL_PARSERS[self.tool_call_parser]().new_call_id()

    def choice_parser(self, request: ToolFields) -> ChoiceParser:
        """How the request's output is read; a 400 for ``"auto"`` on a server without
        ``--enable-auto-tool-choice`` (as vLLM)."""
        choice = request.effective_tool_choice
        reasoning = (None if self.reasoning_parser is None
                     else REASONING_PARSERS[self.reasoning_parser]())
        if isinstance(choice, NamedToolChoice):
            return ChoiceParser(NamedFunctionOutput(choice.function.name), None, 1)
        if choice == "required":
            return ChoiceParser(RequiredCallsOutput(), None, request.max_tool_calls)
        if choice == "none":
            return ChoiceParser(None, reasoning, None)
        if not self.enable_auto_tool_choice or self.tool_call_parser is None:
            raise OpenAIError(
                HTTPStatus.BAD_REQUEST,
                'tool_choice: "auto" needs the server to run with --enable-auto-tool-choice '
                "and --tool-call-parser (tool_choice left unset with tools means \"auto\")",
                param="tool_choice", code="invalid_value")
        return ChoiceParser(TOOL_PARSERS[self.tool_call_parser](), reasoning,
                            request.max_tool_calls)


def add_output_parsing_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
        help="how tool calls are read from the model's text with tool_choice 'auto' "
        "(hermes: Qwen2.5/Qwen3/Hermes, llama3_json: Llama 3.1-3.3, mistral); 'required' and "
        "named choices need none (default: none)")
    group.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help="allow tool_choice 'auto' (the default when a request has tools), read with "
        "--tool-call-parser")
    group.add_argument(
        "--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
        help="return the model's <think>...</think> as reasoning_content (qwen3, deepseek_r1) "
        "(default: none)")


def output_parsing_from_args(args: argparse.Namespace) -> OutputParsing:
    return OutputParsing(args.tool_call_parser, args.enable_auto_tool_choice,
                         args.reasoning_parser)
