"""The one exception the policy adapter raises for bad input, with a message that locates the mistake."""

from __future__ import annotations

MAX_VALUE_CHARS = 200  # a value shown in a message is cut here: a hostile input must not make a huge message


def short_repr(value: object, limit: int = MAX_VALUE_CHARS) -> str:
    """repr(value) cut to `limit` characters, or its type where repr itself fails."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001  (a user object whose __repr__ fails)
        text = f"<{type(value).__name__} object with a failing repr>"
    if len(text) > limit:
        text = f"{text[:max(limit - 30, 10)]}... ({len(text)} characters)"
    return text


class PolicyError(ValueError):
    """Bad constraints or policy: names where (file/entry/line), the field, the value and what was expected."""

    def __init__(self, where: str, field: str, value: object, expected: str):
        self.where = where
        self.field = field
        self.value = value
        self.expected = expected
        super().__init__(f"{where}: field {short_repr(field)} got {short_repr(value)}; expected {expected}")
