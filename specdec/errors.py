"""Errors a request can end with, each mapped to an HTTP status by the ingress."""


class RequestError(ValueError):
    """The request itself is wrong (HTTP 400); the message says what to change."""

    status_code = 400

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class ContextLengthError(RequestError):
    """Prompt plus max_tokens does not fit the model's context (HTTP 400)."""


class UnknownModelError(RequestError):
    """The request names a model this service does not serve (HTTP 404)."""

    status_code = 404


class CapacityError(RuntimeError):
    """The service is full right now; retry later (HTTP 503)."""

    status_code = 503
