"""The error contract: every failure is `{"error": str, "error_type": str}` with a fixed status,
and on OpenAI's routes OpenAI's `{"error": {"message", "type", "param", "code"}}`.

The error types are text-embeddings-inference's, and so are the statuses except three: empty
input is 422 here, a failed batch 500, a request past its deadline 504.
"""

from __future__ import annotations


def is_openai_path(path: str) -> bool:
    """OpenAI's routes: /v1/..., and /embeddings and /models[/name] for a base URL without /v1."""
    return path in ("/embeddings", "/models") or path.startswith(("/v1/", "/models/"))


def error_body(path: str, message: str, error_type: str) -> dict:
    """TEI's error body, or OpenAI's on its routes: the `openai` client (and LangChain over it)
    shows `error.message`, and of TEI's body it showed only the status code."""
    if is_openai_path(path):
        return {"error": {"message": message, "type": error_type, "param": None, "code": None}}
    return {"error": message, "error_type": error_type}


class ServiceError(Exception):
    status: int = 500
    error_type: str = "Backend"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def body(self, path: str) -> dict:
        return error_body(path, self.message, self.error_type)


class InvalidInput(ServiceError, ValueError):
    """Malformed or empty input. A ValueError too: raised in a pydantic validator (`inputs.py`'s rules
    are the HTTP schemas'), pydantic reports it at the field it refuses."""

    status = 422
    error_type = "Validation"


class TooLarge(ServiceError):
    """Too many inputs, too long an input, or too big a body (TEI's Validation -> 413)."""

    status = 413
    error_type = "Validation"


class Overloaded(ServiceError):
    status = 429
    error_type = "Overloaded"

    def __init__(self, message: str = "Model is overloaded"):
        super().__init__(message)


class Unavailable(ServiceError):
    status = 503
    error_type = "Unhealthy"


class GatewayTimeout(ServiceError):
    """The request was not answered within --request-timeout; its queued inputs were dropped."""

    status = 504
    error_type = "Timeout"


class Unauthorized(ServiceError):
    status = 401
    error_type = "Unauthorized"


class NotSupported(ServiceError):
    """The request needs a model this server does not hold (e.g. /classify without a classifier)."""

    status = 400
    error_type = "Validation"


class ModelNotFound(ServiceError):
    """`model` names no model this server holds (OpenAI answers 404 here too)."""

    status = 404
    error_type = "NotFound"


class BackendFailure(ServiceError):
    """A batch failed to run; only that batch's requests see this."""

    status = 500
    error_type = "Backend"
