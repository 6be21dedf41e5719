"""What every endpoint group's protocol shares: integers as JSON Schema counts them, the domain-name rule, and the
OpenAI error shape every error is answered in."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, StringConstraints
from pydantic import StrictInt as _StrictInt


def _integral(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


# JSON Schema counts 12.0 as an integer; so does the gateway (anything else non-integral is refused, as strict ints).
StrictInt = Annotated[_StrictInt, BeforeValidator(_integral)]
# Unicode White_Space (what `\s` matches in pydantic-core's and jsonschema-rs's Rust regex). Python's str.strip() also
# strips U+001C-U+001F, which a schema-valid text may consist of; and the fuzzers' generators read `\s` their own way,
# so the schema spells the class out.
WHITE_SPACE = "\t\n\v\f\r \x85\xa0\u1680" + "".join(chr(c) for c in range(0x2000, 0x200B)) + "\u2028\u2029\u202f\u205f\u3000"
# A string with some character that is not white space (the schema form of `not blank(text)`), each excluded character
# as a \uXXXX escape, which every engine and generator reads alike.
NONBLANK = "[^" + "".join(f"\\u{ord(c):04x}" for c in WHITE_SPACE) + "]"
# Text with some character that is not white space: the rule in the schema, so a schema-valid request is never refused.
NonBlankStr = Annotated[str, StringConstraints(strict=True, pattern=NONBLANK)]


def blank(text: str) -> bool:
    """No character but white space, as the schema's NONBLANK pattern sees it."""
    return not text.strip(WHITE_SPACE)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None  # a specific code ("invalid_api_key"), else the status's ("not_found")


class ErrorResponse(BaseModel):
    error: ErrorInfo
