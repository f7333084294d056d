"""Jinja2's tests (``x is name``, ``x is name(arg)``, ``x is name arg``), as its tests.py defines them."""

from __future__ import annotations

from collections import abc
from numbers import Number
from typing import Any, Callable

from runtime.tokenizer.chat.values import Undefined


def _iterable(value: object) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return True


def _sequence(value: object) -> bool:
    try:
        len(value)
        value.__getitem__  # Jinja2 asks for both a length and item access
    except Exception:
        return False
    return True


TESTS: dict[str, Callable[..., Any]] = {
    "defined": lambda v: not isinstance(v, Undefined),
    "undefined": lambda v: isinstance(v, Undefined),
    "none": lambda v: v is None,
    "boolean": lambda v: v is True or v is False,
    "true": lambda v: v is True,
    "false": lambda v: v is False,
    "integer": lambda v: isinstance(v, int) and v is not True and v is not False,
    "float": lambda v: isinstance(v, float),
    "number": lambda v: isinstance(v, Number),  # booleans are numbers, as in Python and Jinja2
    "string": lambda v: isinstance(v, str),
    "mapping": lambda v: isinstance(v, abc.Mapping),
    "iterable": _iterable,
    "sequence": _sequence,
    "callable": callable,
    "odd": lambda v: v % 2 == 1,
    "even": lambda v: v % 2 == 0,
    "divisibleby": lambda v, num: v % num == 0,
    "lower": lambda v: str(v).islower(),
    "upper": lambda v: str(v).isupper(),
    "in": lambda v, seq: v in seq,
    "sameas": lambda v, other: v is other,
    "eq": lambda a, b: a == b, "equalto": lambda a, b: a == b, "==": lambda a, b: a == b,
    "ne": lambda a, b: a != b, "!=": lambda a, b: a != b,
    "lt": lambda a, b: a < b, "lessthan": lambda a, b: a < b, "<": lambda a, b: a < b,
    "le": lambda a, b: a <= b, "<=": lambda a, b: a <= b,
    "gt": lambda a, b: a > b, "greaterthan": lambda a, b: a > b, ">": lambda a, b: a > b,
    "ge": lambda a, b: a >= b, ">=": lambda a, b: a >= b,
}
