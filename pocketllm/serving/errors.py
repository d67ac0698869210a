"""OpenAI-style errors: every refused request answers a 4xx (or a 5xx for the server's own
failure) with {"error": {"message", "type", "param", "code"}}, the body OpenAI's clients parse."""

from __future__ import annotations

# The error type OpenAI's API names for each status this server answers with.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """A request the server refuses or cannot finish: one line of message, the field it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)
