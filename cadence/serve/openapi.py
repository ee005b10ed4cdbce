"""The OpenAPI tables: what every route answers, and how it is secured, as ``/openapi.json`` documents it.

:class:`RouteDocs` holds, per route handler (``cadence.serve.routes``, by the handler's name), the keywords
its FastAPI route is added with: summary, status code, the documented answers (every status code the route
sends, errors as ``application/json`` ``{"error": ...}``), the request body's schema and the security it
needs. The schema depends on the server's configuration: the operator key (whether the operator routes and
POST /sessions name one), the ``talk`` agent (offered only with an LLM endpoint), the size limits.
:func:`install_openapi` finishes FastAPI's document: no 422 (every refusal here is a 400), the exact seed
bound, the security schemes. ``tests/test_openapi.py`` holds the document against the server's answers
(and schemathesis against a live server).
"""

from __future__ import annotations

from cadence.serve.agent import SayAgent
from cadence.serve.agents import AGENTS
from cadence.serve.config import DEFAULT_PROMPT
from cadence.serve.guard import MAX_PROMPT, MAX_SEED, SDP_PATTERN

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {"error": {"type": "string", "description": "one line, for a person"}},
}
RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before trying again",
        "required": True,
        "schema": {"type": "integer", "minimum": 1},
    }
}
ERRORS = {
    400: (
        (
            "Bad request: a field missing, of the wrong type, out of range, or text that is not valid Unicode "
            "or carries NUL; not JSON; a malformed SDP offer; an image that is not one"
        ),
        None,
    ),
    401: (
        "No credential, or an invalid API key (Authorization: Bearer ...)",
        {"WWW-Authenticate": {"description": "Bearer", "required": True, "schema": {"type": "string"}}},
    ),
    403: (
        (
            "The credential does not open this resource (another session's token), or the route needs the "
            "operator key and this server has none"
        ),
        None,
    ),
    404: ("No such session (or its report has expired), or no such route", None),
    409: ("The session is still open: its report is written when it closes", None),
    410: ("The session is closed (its state and report stay readable for a while)", None),
    413: ("Body, image (bytes or pixels), SDP offer or audio over its limit", None),
    415: ("A content type this route does not take, or audio that cannot be decoded", None),
    429: ("This client already has as many sessions waiting to connect as it may", RETRY_AFTER),
    500: ("The session could not be started (the worker failed)", None),
    503: ("No free session slot, or a server-side dependency missing (espeak-ng for 'say')", RETRY_AFTER),
}
#: What every ``/sessions/{id}`` route may answer besides its own codes.
SESSION_ROUTE = (400, 401, 403, 404, 413)
#: A text field's schema: no NUL.
TEXT = {"type": "string", "pattern": "^[^\\u0000]*$"}
#: A text field's schema: not only whitespace, no NUL.
NON_BLANK = "^[^\\u0000]*[^\\s\\u0000][^\\u0000]*$"


def errors(*codes: int) -> dict:
    """The documented answers for error ``codes`` (each an ``{"error": ...}`` JSON body)."""
    out = {}
    for c in codes:
        desc, headers = ERRORS[c]
        if c == 503:
            headers = None  # a 503 for a missing espeak-ng carries no Retry-After; a full server's does
        out[c] = {
            "description": desc,
            "content": {"application/json": {"schema": ERROR_SCHEMA}},
            **({"headers": headers} if headers else {}),
        }
    return out


def ok(description: str, schema: dict | None = None, status: int = 200) -> dict:
    """The documented success answer (JSON, ``schema`` or any object)."""
    return {
        status: {
            "description": description,
            "content": {"application/json": {"schema": schema or {"type": "object"}}},
        }
    }


def json_body(schema: dict) -> dict:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


CREATED = {
    "type": "object",
    "required": ["session_id", "token", "sdp", "type"],
    "properties": {
        "session_id": {"type": "string"},
        "token": {
            "type": "string",
            "description": "this session's secret: send it as 'Authorization: Bearer "
            "<token>' on every /sessions/{id} route; shown only here",
        },
        "sdp": {"type": "string"},
        "type": {"type": "string", "enum": ["answer"]},
        "agent": {"type": "string"},
        "preset": {"type": "string"},
        "fps": {"type": "integer"},
        "width": {"type": "integer"},
        "height": {"type": "integer"},
    },
}
SAY = {
    "type": "object",
    "required": ["text"],
    "properties": {
        "text": {
            "type": "string",
            "minLength": 1,
            "maxLength": SayAgent.max_text,
            "pattern": NON_BLANK,
            "description": "what to say (not only whitespace, no NUL)",
        },
        "interrupt": {"type": "boolean", "default": False, "description": "drop what is queued first"},
    },
}
PROMPT = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "prompt": {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_PROMPT,
            "pattern": NON_BLANK,
            "description": "the new prompt (not only whitespace, no NUL)",
        }
    },
}


class RouteDocs:
    """Each route's FastAPI keywords for a server configured by ``cfg``, one method per handler name.

    A server without an operator key has no credential to ask for on the operator routes (they are off,
    403), so its spec names none there; every session route takes the session's token (or the key)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.operator = [{"apiKey": []}] if cfg.api_key else []
        self.per_session = [{"sessionToken": []}, {"apiKey": []}] if cfg.api_key else [{"sessionToken": []}]
        self.key_401 = (401,) if cfg.api_key else ()

    def for_route(self, name: str) -> dict:
        return getattr(self, name)()

    def index(self) -> dict:
        return {"include_in_schema": False}

    def healthz(self) -> dict:
        return {"summary": "Liveness", "responses": ok("Liveness and free slots")}

    def config(self) -> dict:
        return {
            "summary": "What the page needs: geometry, agents, limits, whether an API key is needed",
            "responses": ok("The server's configuration"),
        }

    def create_session(self) -> dict:
        return {
            "status_code": 201,
            "summary": "Start a session: SDP offer in, SDP answer (+ token) out",
            "responses": {
                **ok("The SDP answer, the session id and its token", CREATED, 201),
                **errors(400, *self.key_401, 413, 415, 429, 500, 503),
            },
            "openapi_extra": {"security": self.operator, "requestBody": self._session_body()},
        }

    def _session_body(self) -> dict:
        cfg = self.cfg
        fields = {
            "sdp": {
                "type": "string",
                "minLength": 1,
                "pattern": SDP_PATTERN,
                "description": "the client's SDP offer (a recvonly video "
                "transceiver; audio sendrecv for the microphone)",
            },
            "type": {"type": "string", "enum": ["offer"], "default": "offer"},
            "prompt": {**TEXT, "maxLength": MAX_PROMPT, "description": f"default: {DEFAULT_PROMPT!r}"},
            "agent": {
                "type": "string",
                "enum": sorted(a for a in AGENTS if a != "talk" or cfg.agent_url is not None),
                "default": "mirror",
            },
        }
        image = (
            "the reference image (PNG, JPEG, WebP, ...), base64; "
            f"at most {cfg.max_image_bytes} bytes and {cfg.max_image_pixels} pixels"
        )
        seed_json = {"type": "integer", "minimum": 0, "maximum": MAX_SEED, "default": 0}
        seed_form = {"type": "string", "pattern": "^[0-9]{0,19}$", "description": f"0..{MAX_SEED}"}
        as_json = {
            "seed": seed_json,
            "image_base64": {"type": "string", "contentEncoding": "base64", "description": image},
        }
        form = {"seed": seed_form, "image": {"type": "string", "format": "binary"}}
        return {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {"type": "object", "required": ["sdp"], "properties": {**fields, **as_json}}
                },
                "multipart/form-data": {
                    "schema": {"type": "object", "required": ["sdp"], "properties": {**fields, **form}}
                },
            },
        }

    def list_sessions(self) -> dict:
        return {
            "summary": "Open sessions (needs the operator key; off on a server without one)",
            "responses": {**ok("Every open session's state"), **errors(*self.key_401, 403)},
            "openapi_extra": {"security": self.operator},
        }

    def _session(self, summary: str, answer: str, *codes: int, body: dict | None = None) -> dict:
        extra = {"security": self.per_session}
        if body is not None:
            extra["requestBody"] = body
        return {
            "summary": summary,
            "responses": {**ok(answer), **errors(*SESSION_ROUTE, *codes)},
            "openapi_extra": extra,
        }

    def get_session(self) -> dict:
        return self._session("A session's state (a closed one: its final state)", "The session's state")

    def get_report(self) -> dict:
        return self._session("A closed session's report", "The session's report", 409)

    def delete_session(self) -> dict:
        return self._session("Close a session; its report", "The session's report", 410)

    def say(self) -> dict:
        return self._session(
            "The character says a line of text (espeak-ng)",
            "Seconds of speech queued",
            410,
            503,
            body=json_body(SAY),
        )

    def set_prompt(self) -> dict:
        return self._session(
            "Change the prompt from the next chunk on (the stream goes on)",
            "The chunk the new prompt starts at",
            410,
            body=json_body(PROMPT),
        )

    def push_audio(self) -> dict:
        binary = {"schema": {"type": "string", "format": "binary"}}
        return self._session(
            "Queue speech audio (any format FFmpeg decodes) for the character",
            "Seconds of speech queued",
            410,
            415,
            body={"required": True, "content": {"application/octet-stream": binary, "audio/wav": binary}},
        )

    def interrupt(self) -> dict:
        return self._session("Stop speaking", "Interrupted", 410)

    def metrics(self) -> dict:
        from fastapi.responses import Response

        text = {"text/plain": {"schema": {"type": "string"}}}
        return {
            "summary": "Prometheus text exposition (per-session series with the operator key)",
            "response_class": Response,
            "responses": {200: {"description": "Prometheus text format", "content": text}},
            "openapi_extra": {"security": [{}, {"apiKey": []}] if self.cfg.api_key else []},
        }


def install_openapi(app, cfg) -> None:
    """``app.openapi``: FastAPI's document, finished once (then cached)."""
    from fastapi.openapi.utils import get_openapi

    def openapi():
        if app.openapi_schema is None:
            spec = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            app.openapi_schema = finish(spec, cfg)
        return app.openapi_schema

    app.openapi = openapi


def finish(spec: dict, cfg) -> dict:
    """No 422 (FastAPI's own; every refusal here is a 400), the exact seed bound, the security schemes."""
    for ops in spec.get("paths", {}).values():
        for op in ops.values():
            op.get("responses", {}).pop("422", None)
    # FastAPI's spec model turns 2^63 - 1 into a float (2^63): put the exact bound back
    body = spec["paths"]["/sessions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    body["properties"]["seed"]["maximum"] = MAX_SEED
    comps = spec.setdefault("components", {})
    for name in ("HTTPValidationError", "ValidationError"):
        comps.get("schemas", {}).pop(name, None)
    comps["securitySchemes"] = {
        "sessionToken": {
            "type": "http",
            "scheme": "bearer",
            "description": "the token POST /sessions returned for this session",
        }
    }
    if cfg.api_key:
        comps["securitySchemes"]["apiKey"] = {
            "type": "http",
            "scheme": "bearer",
            "description": "the operator key (cadence serve --api-key-file / --api-key)",
        }
    return spec
