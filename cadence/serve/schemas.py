"""What the HTTP API takes and answers, as pydantic models: each request is validated by its model, and the
OpenAPI document (``/openapi.json``) is generated from the same models, so the two cannot drift apart.

* Requests: :class:`SayRequest`, :class:`PromptRequest` (FastAPI validates them as the routes' bodies) and the
  two forms of ``POST /sessions`` (:func:`session_models`: JSON with a base64 image, or a multipart form with an
  image file; built per server, since the agents offered depend on its configuration).
* Answers: :class:`SessionCreated`, :class:`Queued`, :class:`PromptSwitched`, :class:`Interrupted`,
  :class:`Health`, and :class:`ErrorBody`, the one shape of every refusal (``{"error": "<one line>"}``).
* :func:`validation_message`: a model's first complaint as one line for a person, naming the field
  (``'seed' must be an integer in 0..2^63-1, got a string``), never pydantic's or Python's internals.

A text field's schema pattern is the server's own check (no NUL; not only whitespace where that is said),
made by a validator with a message of its own, so a string the schema allows is one the server takes.
"""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, create_model
from pydantic_core import PydanticCustomError

from cadence.serve.agent import SayAgent
from cadence.serve.agents import AGENTS

MAX_PROMPT = 1000
MAX_SEED = 2**63 - 1
#: Longest text ``/say`` takes.
MAX_SAY = SayAgent.max_text
#: A text field: no NUL.
TEXT_PATTERN = "^[^\\u0000]*$"
#: A text field that must say something: not only whitespace, no NUL.
NON_BLANK_PATTERN = "^[^\\u0000]*[^\\s\\u0000][^\\u0000]*$"
#: A seed as a form field: decimal digits (0..2^63-1: at most 19 of them).
SEED_FORM_PATTERN = "^[0-9]{0,19}$"


# ---- field checks (each with its own message) -----------------------------------------------------------


def _no_nul(value: str) -> str:
    if "\0" in value:
        raise PydanticCustomError("nul", "contains a NUL character (at {at})", {"at": value.index("\0")})
    return value


def _not_blank(value: str) -> str:
    if not value.strip():
        raise PydanticCustomError("blank", "is empty (a non-empty string, not only whitespace)")
    return value


def _seed_digits(value: str) -> int:
    """A form field's seed: ``""`` is 0; else decimal digits within 0..2^63-1."""
    if value == "":
        return 0
    if not (value.isascii() and value.isdigit()) or len(value) > 19 or int(value) > MAX_SEED:
        raise PydanticCustomError(
            "seed", "must be an integer in 0..{max}, got {got}", {"max": MAX_SEED, "got": repr(value[:30])}
        )
    return int(value)


def text_field(max_chars: int | None = None, *, non_blank: bool = False, **kw) -> Any:
    """A string field of a request: no NUL (``TEXT_PATTERN``), or not blank either (``NON_BLANK_PATTERN``);
    at most ``max_chars``."""
    checks = [AfterValidator(_no_nul)] + ([AfterValidator(_not_blank)] if non_blank else [])
    pattern = NON_BLANK_PATTERN if non_blank else TEXT_PATTERN
    limits = {"max_length": max_chars} if max_chars is not None else {}
    if non_blank:
        limits["min_length"] = 1
    return Annotated[str, Field(json_schema_extra={"pattern": pattern}, **limits, **kw), *checks]


# ---- requests ----------------------------------------------------------------------------------------------


class SayRequest(BaseModel):
    """``POST /sessions/{id}/say``."""

    text: text_field(MAX_SAY, non_blank=True, description="what to say (not only whitespace, no NUL)")
    interrupt: StrictBool = Field(False, description="drop what is queued first")


class PromptRequest(BaseModel):
    """``POST /sessions/{id}/prompt``."""

    prompt: text_field(MAX_PROMPT, non_blank=True, description="the new prompt (not only whitespace, no NUL)")


#: What the SDP field says in the schema (the pattern is the server's first check of an offer:
#: ``cadence.serve.guard.SDP_PATTERN``).
SDP_DESCRIPTION = "the client's SDP offer (a recvonly video transceiver; audio sendrecv for the microphone)"


def session_models(agents: tuple[str, ...], sdp_pattern: str, max_image_bytes: int, max_image_pixels: int):
    """The two bodies ``POST /sessions`` takes, ``(SessionRequest, SessionForm)``: JSON (the image base64) and a
    multipart form (the image a file, the seed in digits), with the agents this server offers (the schema
    lists those; a known agent this server does not offer, ``talk`` without an endpoint, is the session
    manager's 400, which says what it needs)."""
    agent = Annotated[
        Literal[tuple(sorted(AGENTS))],  # type: ignore[valid-type]
        Field(json_schema_extra={"enum": sorted(agents)}),
    ]
    image = (
        f"the reference image (PNG, JPEG, WebP, ...); at most {max_image_bytes} bytes and "
        f"{max_image_pixels} pixels"
    )
    common = {
        "sdp": (
            Annotated[
                str,
                Field(min_length=1, json_schema_extra={"pattern": sdp_pattern}, description=SDP_DESCRIPTION),
                AfterValidator(_no_nul),
            ],
            ...,
        ),
        "type": (Literal["offer"], "offer"),
        "prompt": (text_field(MAX_PROMPT, description="default: the server's prompt"), ""),
        "agent": (agent, "mirror"),
    }
    as_json = create_model(
        "SessionRequest",
        __base__=_Lenient,
        **common,
        seed=(StrictInt, Field(0, ge=0, le=MAX_SEED)),
        image_base64=(
            str | None,
            Field(None, json_schema_extra={"contentEncoding": "base64"}, description=image + ", base64"),
        ),
    )
    form = create_model(
        "SessionForm",
        __base__=_Lenient,
        **common,
        seed=(
            Annotated[
                str,
                Field(
                    json_schema_extra={"pattern": SEED_FORM_PATTERN},
                    description=f"0..{MAX_SEED}",
                    validate_default=True,  # (absent: "" -> 0, an integer like the JSON seed)
                ),
                AfterValidator(_seed_digits),
            ],
            "",
        ),
        image=(
            bytes | None,
            Field(None, json_schema_extra={"format": "binary"}, description=image + ", a file"),
        ),
    )
    return as_json, form


class _Lenient(BaseModel):
    """A request whose unknown fields are ignored (clients may send more than this server reads)."""

    model_config = ConfigDict(extra="ignore")


# ---- answers -----------------------------------------------------------------------------------------------


class ErrorBody(BaseModel):
    """Every refusal: one line, for a person."""

    model_config = ConfigDict(extra="forbid")
    error: str = Field(description="one line, for a person")


class SessionCreated(BaseModel):
    """What ``POST /sessions`` answers (201): the session's id and its token (shown only here), the SDP answer,
    and what the client will receive."""

    session_id: str
    token: str = Field(
        description="this session's secret: send it as 'Authorization: Bearer <token>' on every "
        "/sessions/{id} route; shown only here"
    )
    sdp: str
    type: Literal["answer"]
    agent: str
    preset: str
    fps: int
    width: int
    height: int

    def as_json(self) -> dict:
        return self.model_dump()


class Queued(BaseModel):
    """Speech queued for the character (``/say``, ``/audio``)."""

    session_id: str
    seconds: float = Field(description="how long the speech queued now lasts")
    queued_s: float = Field(description="speech queued in all, this included")


class PromptSwitched(BaseModel):
    session_id: str
    from_chunk: int = Field(description="the chunk the new prompt starts at")


class Interrupted(BaseModel):
    session_id: str
    interrupted: Literal[True]


class Health(BaseModel):
    ok: bool = Field(description="the workers are ready")
    groups: int
    free: int = Field(description="worker groups free for a new session")
    sessions: int


# ---- refusals ------------------------------------------------------------------------------------------------


def type_name(value) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        bytes: "bytes",
        list: "an array",
        dict: "an object",
        type(None): "null",
    }.get(type(value), "a value of another kind")


def _field(loc: tuple) -> str:
    parts = [str(x) for x in loc if x != "body"]
    return "'" + ".".join(parts) + "'" if parts else "the request body"


def validation_message(errors: list[dict], shape: str = "") -> str:
    """The first of a model's ``errors`` (pydantic's ``ValidationError.errors()``) as one line naming the field;
    ``shape``: what the body should look like (for a body that is not a JSON object)."""
    if not errors:
        return "invalid request"
    e = errors[0]
    where, kind, got, ctx = (
        _field(tuple(e.get("loc", ()))),
        e.get("type", ""),
        e.get("input"),
        e.get("ctx") or {},
    )
    if kind == "json_invalid":
        return "request body is not valid JSON"
    if where == "the request body":
        if kind == "missing":
            return f"missing request body{': ' + shape if shape else ''}"
        return f"request body must be a JSON object{': ' + shape if shape else ''}"
    known = {
        "missing": f"missing {where}",
        "string_type": f"{where} must be a string, got {type_name(got)}",
        "string_unicode": f"{where} is not valid Unicode text (a lone surrogate?)",
        "string_too_long": f"{where} is too long ({len(got) if isinstance(got, str) else '?'} characters; "
        f"limit {ctx.get('max_length')})",
        "string_too_short": f"{where} is empty",
        "int_type": f"{where} must be an integer in 0..{MAX_SEED}, got {type_name(got)}"
        if "seed" in where
        else f"{where} must be an integer, got {type_name(got)}",
        "bool_type": f"{where} must be a boolean, got {type_name(got)}",
        "literal_error": f"{where} must be one of {ctx.get('expected')}, got {str(got)[:64]!r}",
        "less_than_equal": f"{where} is out of range (at most {ctx.get('le')}), got {str(got)[:30]}",
        "greater_than_equal": f"{where} is out of range (at least {ctx.get('ge')}), got {str(got)[:30]}",
    }
    if kind in known:
        return known[kind]
    return f"{where} {e.get('msg', 'is invalid')}"  # our own checks: "contains a NUL character (at 3)", ...
