"""The one exception the policy adapter raises for bad input, with a message that locates the mistake."""

from __future__ import annotations


class PolicyError(ValueError):
    """Bad constraints or policy: names where (file/entry/line), the field, the value and what was expected."""

    def __init__(self, where: str, field: str, value: object, expected: str):
        self.where = where
        self.field = field
        self.value = value
        self.expected = expected
        super().__init__(f"{where}: field {field!r} got {value!r}; expected {expected}")
