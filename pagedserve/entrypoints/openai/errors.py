"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server reports goes through ``OpenAIError`` or one of the handlers installed by
``install_error_handlers``, so a client always gets the same JSON shape, whatever went wrong:
a pydantic validation error, a ``ValueError`` from the engine's input checks (raised inside
``serving_common.engine_errors``, which makes it a 400), an unknown route. Any other exception,
a ``ValueError`` included, is a bug of the server: a 500, logged.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.entrypoints.openai.unsupported_fields import unsupported_message

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    """An error with an HTTP status, reported to the client in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    err_type = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


_LEADING_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\[\d+\])?(?:\.[A-Za-z_][A-Za-z0-9_]*)*)\b")


def param_from_message(message: str) -> str | None:
    """The field a ``ValueError`` names: its messages start with the field (``top_p must ...``,
    ``stop: at most ...``), the convention of ``SamplingParams.validate`` and the config checks."""
    match = _LEADING_NAME.match(message)
    if match is None:
        return None
    name = match.group(1)
    # A capitalised first word is prose ("This model's ..."), not a field name.
    return None if name[0].isupper() else name


def format_loc(loc: Sequence[str | int]) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``."""
    parts = [p for p in loc if p not in ("body", "query", "path")]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _is_type_tag(part):
            continue  # pydantic names the union member it tried ("str", "list[int]"): not a field
        else:
            out += f".{part}" if out else str(part)
    return out or None


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "dict", "list", "function-after")


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """Map pydantic's error list to one 400 that names the first offending field.

    A field with a union type (``prompt``: string, strings, token ids, ...) yields one error per
    alternative; they are joined into one message so the client sees every accepted shape."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(
            f"request body is not valid JSON: {first.get('msg', '')}", code="invalid_json"
        )
    # An undeclared field is named first, unless it sits under a union (a content part of an
    # unknown type is reported as the union's alternatives, below).
    extra = next((e for e in errors if e.get("type") == "extra_forbidden"
                  and not _has_type_tag(e.get("loc", ()))), None)
    if extra is not None:
        param = format_loc(extra["loc"])
        message, code = unsupported_message(param or "", str(extra["loc"][-1]))
        return bad_request(message, param=param, code=code)
    param = format_loc(first.get("loc", ()))
    if first.get("type") == "missing":
        return bad_request(
            f"{param}: field required" if param else "request body is required", param=param
        )
    field = _top_field(first.get("loc", ()))
    same_field = [e for e in errors if _top_field(e.get("loc", ())) == field]
    if len(same_field) > 1 and any(_has_type_tag(e.get("loc", ())) for e in same_field):
        union_param = format_loc(_common_prefix([_strip_tags(e["loc"]) for e in same_field]))
        alternatives = "; ".join(f"as {_type_tag(e['loc'])}: {e['msg']}" for e in same_field[:4])
        return bad_request(f"{union_param}: invalid value ({alternatives})", param=union_param)
    msg = str(first.get("msg", "invalid value"))
    return bad_request(f"{param}: {msg}" if param else msg, param=param)


def _top_field(loc: Sequence[str | int]) -> str | None:
    names = [p for p in loc if p not in ("body", "query", "path")]
    return str(names[0]) if names else None


def _strip_tags(loc: Sequence[str | int]) -> list[str | int]:
    return [p for p in loc if not (isinstance(p, str) and _is_type_tag(p))]


def _common_prefix(locs: list[list[str | int]]) -> list[str | int]:
    prefix = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(prefix), len(loc)) and prefix[n] == loc[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


def _has_type_tag(loc: Sequence[str | int]) -> bool:
    return any(isinstance(p, str) and _is_type_tag(p) for p in loc)


def _type_tag(loc: Sequence[str | int]) -> str:
    return next((p for p in loc if isinstance(p, str) and _is_type_tag(p)), "value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        err = OpenAIError(
            exc.status_code,
            message,
            code=getattr(exc, "openai_code", None),
            headers=getattr(exc, "headers", None),
        )
        return err.response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return OpenAIError(
            500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"
        ).response()
