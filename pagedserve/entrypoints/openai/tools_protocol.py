"""Tool fields of a chat completions request (``tools``, ``tool_choice``,
``parallel_tool_calls``, and the tool calls of assistant messages), and the constraint that
``tool_choice`` ``"required"`` or a named function puts on decoding."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pagedserve.entrypoints.openai.tool_parsers.forced import EMPTY_PARAMETERS, required_schema
from pagedserve.entrypoints.openai.unsupported_fields import RequestBody
from pagedserve.structured_output.params import StructuredOutputsParams

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(RequestBody):
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema (an object's).")
    strict: bool | None = Field(
        None, description="Accepted; with tool_choice 'required' or named, the schema is always "
        "enforced.")


class ChatTool(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: ToolChoiceFunction


class MessageFunctionCall(RequestBody):
    name: str
    arguments: str = Field(..., description="JSON text of the arguments object.")


class MessageToolCall(RequestBody):
    """A call an earlier assistant turn made."""

    id: str
    type: Literal["function"] = "function"
    function: MessageFunctionCall


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(RequestBody):
    """Mixed into the chat completions request body."""

    tools: list[ChatTool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = Field(
        None, description="Default: 'auto' when tools are given (needs the server's "
        "--enable-auto-tool-choice), else 'none'.")
    parallel_tool_calls: bool | None = Field(
        None, description="Default true; false: at most one call per completion.")

    def check_tool_choice(self) -> None:
        """ValueError naming the field when ``tool_choice`` does not fit ``tools``."""
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice: needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.tool_names():
            raise ValueError(f"tool_choice.function.name: {choice.function.name!r} is not one "
                             "of the tools")

    def tool_names(self) -> list[str]:
        return [tool.function.name for tool in self.tools or []]

    @property
    def effective_tool_choice(self) -> ToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def max_tool_calls(self) -> int | None:
        return 1 if self.parallel_tool_calls is False else None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` as the chat template reads them (transformers' ``tools=``)."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def tool_constraint(self) -> StructuredOutputsParams | None:
        """The decoding constraint of ``tool_choice`` ``"required"`` or a named function."""
        choice = self.effective_tool_choice
        functions = {t.function.name: t.function.parameters for t in self.tools or []}
        if isinstance(choice, NamedToolChoice):
            schema = functions[choice.function.name] or EMPTY_PARAMETERS
            where = f"tools[{self.tool_names().index(choice.function.name)}].function.parameters"
        elif choice == "required":
            schema = required_schema(list(functions.items()), self.max_tool_calls)
            where = "tools"
        else:
            return None
        try:
            return StructuredOutputsParams(json=schema)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}".replace("structured_outputs.json: ", "")) from None
