"""OpenAI error bodies: {"error": {"message", "type", "param", "code"}} for every failure."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "internal_server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def from_validation(exc: ValidationError | RequestValidationError) -> APIError:
    """The first pydantic error as a 400, its location as the OpenAI `param`."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return _invalid_json(first, getattr(exc, "body", None))
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if not loc:
        return _not_an_object(first)
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    return APIError(400, f"{param}: {msg}" if param else msg, param)


def _not_an_object(error: Any) -> APIError:
    """The body as a whole is no JSON object. FastAPI parses JSON only under a JSON content
    type, so `curl -d` (form-urlencoded) or a client that sends none hands it raw bytes."""
    if isinstance(error.get("input"), bytes):
        return APIError(
            400, "the request body must be JSON, sent as Content-Type: application/json"
        )
    if error.get("type") == "missing":
        return APIError(400, "the request body is empty: send a JSON object")
    return APIError(400, "the request body must be a JSON object")


def _invalid_json(error: Any, body: Any) -> APIError:
    """A body that is not JSON: say where, by line and column (the location is no field)."""
    reason = (error.get("ctx") or {}).get("error", "invalid JSON")
    loc = error.get("loc", ())
    pos = loc[-1] if loc and isinstance(loc[-1], int) else None
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    if pos is None or not isinstance(body, str):
        return APIError(400, f"the request body is not valid JSON: {reason}")
    line = body.count("\n", 0, pos) + 1
    column = pos - (body.rfind("\n", 0, pos) + 1) + 1
    return APIError(
        400, f"the request body is not valid JSON: {reason} at line {line}, column {column}"
    )


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = from_validation(exc)  # FastAPI's 422 is a 400 in OpenAI's API
        return error_response(400, err.message, err.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = 400 if exc.status_code == 422 else exc.status_code
        return error_response(status, str(exc.detail), None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}")
