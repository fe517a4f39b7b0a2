"""Errors the server answers with, in the OpenAI error format."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class APIError(Exception):
    """A request the server refuses: an HTTP status and an OpenAI-style error body.

    Parameters
    ----------
    status : the HTTP status (4xx for what the client can fix).
    message : a sentence the client can act on.
    type : OpenAI's error type (``invalid_request_error``, ``not_found_error``, ...).
    param : the request field at fault, if one is.
    code : a machine-readable code (``context_length_exceeded``, ``rate_limit_exceeded``, ...).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 for a request field out of range or malformed."""
    return APIError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(404, message, type="not_found_error", param=param, code="not_found")


def server_error(error: Exception) -> APIError:
    """``error`` as the request's answer: an :class:`APIError` as it is, anything else a 500."""
    if isinstance(error, APIError):
        return error
    logger.error("the server failed on a request", exc_info=error)  # the details stay in the server's log
    return APIError(
        500, f"the server failed on this request ({type(error).__name__}; see the server's log)", type="server_error"
    )
