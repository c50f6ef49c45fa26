"""The one exception hierarchy of lorad.

Every error a user can cause is a `LoradError` with an HTTP status; the API maps them to
`{"error": {"message", "type", "code"}}` in exactly one place (daemon/server/api.py), the CLI to a message
and exit code 2. Anything else escaping is a bug in lorad.
"""


def clip(value, limit: int = 80) -> str:
    """repr(value) cut to `limit` characters: what a client sent, echoed into a message or a log line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}...({len(text)} chars)"


class LoradError(Exception):
    status = 500
    type = "internal_error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(LoradError):
    status = 400
    type = "invalid_request_error"

    @classmethod
    def malformed(cls, kind: str, error: Exception) -> "BadRequest":
        """A file of `kind` (trace, profile) whose JSON lacks a field or holds a value of the wrong type."""
        if isinstance(error, KeyError):
            return cls(f"malformed {kind}: it has no {error.args[0]!r} field")
        return cls(f"malformed {kind}: {error}")


class PromptTooLong(BadRequest):
    status = 400
    type = "context_length_exceeded"


class Unauthorized(LoradError):
    """A request over TCP without the daemon's API key (Authorization: Bearer KEY)."""

    status = 401
    type = "authentication_error"


class Forbidden(LoradError):
    """A caller who may not do this (adapter admin outside the admin gate)."""

    status = 403
    type = "permission_error"


class NotFound(LoradError):
    status = 404
    type = "not_found_error"


class ModelNotFound(NotFound):
    """The `model` of a request names neither the base model nor a registered adapter."""

    type = "model_not_found"

    @classmethod
    def named(cls, model, where: str = "(GET /v1/models lists the base model and adapters)") -> "ModelNotFound":
        """The refusal of `model`, worded once for every place that refuses it; `where` says where to look."""
        return cls(f"the model {clip(model)} does not exist {where}")


class MethodNotAllowed(LoradError):
    status = 405
    type = "method_not_allowed"


class BodyTooLarge(LoradError):
    status = 413
    type = "request_too_large"


class AdapterError(LoradError):
    """An adapter that cannot be served: missing, corrupt, pickled, of the wrong shape..."""

    status = 400
    type = "adapter_error"


class ModelError(LoradError):
    """A base checkpoint lorad cannot serve (unknown architecture, missing tensors...)."""

    status = 500
    type = "model_error"


class Overloaded(LoradError):
    status = 503
    type = "overloaded_error"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AdmissionDropped(Overloaded):
    """The admission policy gave up on a queued request: early abort predicted it could no longer meet
    its time-to-first-token objective (scheduler/admission.py)."""

    type = "admission_dropped"


class ServiceUnavailable(LoradError):
    """A part of the daemon a request needs is down for now (the large-body parser); the next request restarts it."""

    status = 503
    type = "unavailable_error"


class EngineDead(LoradError):
    status = 500
    type = "engine_error"


class BackendError(LoradError):
    """`lorad router`: the backend engine a request was routed to failed or could not be reached."""

    status = 502
    type = "backend_error"
