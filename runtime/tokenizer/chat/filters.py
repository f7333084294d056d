"""Filters (``x | name(args)``), each as Jinja2 3.1's filters.py defines it with autoescape off, and ``tojson``
as transformers overrides it: ``json.dumps(x, ensure_ascii=False, indent, separators, sort_keys)`` (no HTML
escaping). Generators stay generators where Jinja2's do (``map``, ``select``, ``reverse``...), so what prints is
what Jinja2 prints."""

from __future__ import annotations

import json
import math
import re
from collections import abc
from itertools import chain
from typing import Any, Callable

from runtime.tokenizer.chat.errors import TemplateRuntimeError
from runtime.tokenizer.chat.predicates import TESTS
from runtime.tokenizer.chat.values import Markup, Namespace, Undefined, escape, get_attribute, get_item, safe_attribute

_WORD_START = re.compile(r"([-\s({\[<]+)")
_EMPTY = object()


def _text(value: object) -> str:
    return value if isinstance(value, str) else str(value)


def _ignore_case(value: object) -> object:
    return value.lower() if isinstance(value, str) else value


def _attribute_parts(attribute: object) -> list:
    if attribute is None:
        return []
    if isinstance(attribute, str):
        return [int(part) if part.isdigit() else part for part in attribute.split(".")]
    return [attribute]


def attribute_getter(attribute: object, *, postprocess: Callable | None = None, default: object = None) -> Callable:
    """Jinja2's make_attrgetter: ``"a.b.0"`` reads item a, then b, then 0 (items first, as ``x[k]``)."""
    parts = _attribute_parts(attribute)

    def get(item):
        for part in parts:
            item = get_item(item, part)
            if default is not None and isinstance(item, Undefined):
                item = default
        return postprocess(item) if postprocess is not None else item
    return get


def _sort_key(attribute: object, case_sensitive: bool) -> Callable:
    """Jinja2's make_multi_attrgetter: ``"age,name"`` sorts by several attributes."""
    getters = [attribute_getter(part, postprocess=None if case_sensitive else _ignore_case)
               for part in (attribute.split(",") if isinstance(attribute, str) else [attribute])]
    return lambda item: [get(item) for get in getters]


def do_default(value, default_value="", boolean=False):
    return default_value if isinstance(value, Undefined) or (boolean and not value) else value


def do_attr(value, name):
    """Only the attribute, never the item (unlike ``value.name``)."""
    if isinstance(value, Undefined):
        value.fail()
    if isinstance(value, Namespace):
        return get_attribute(value, str(name))
    try:
        found = getattr(value, str(name))
    except AttributeError:
        return Undefined(obj=value, name=name)
    return found if safe_attribute(value, str(name)) else get_attribute(value, str(name))


def do_items(value):
    if isinstance(value, Undefined):
        return iter(())
    if not isinstance(value, abc.Mapping):
        raise TemplateRuntimeError("the items filter needs a mapping")
    return iter(value.items())


def do_join(value, d="", attribute=None):
    if attribute is not None:
        value = map(attribute_getter(attribute), value)
    return str(d).join(map(str, value))


def do_title(value):
    return "".join(item[0].upper() + item[1:].lower() for item in _WORD_START.split(_text(value)) if item)


def do_first(value):
    return next(iter(value), Undefined("No first item, sequence was empty."))


def do_last(value):
    return next(iter(reversed(value)), Undefined("No last item, sequence was empty."))


def do_replace(value, old, new, count=None):
    return str(value).replace(str(old), str(new), -1 if count is None else count)


def do_int(value, default=0, base=10):
    try:
        return int(value, base) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        try:
            return int(float(value))
        except (TypeError, ValueError, OverflowError):
            return default


def do_float(value, default=0.0):
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def do_round(value, precision=0, method="common"):
    if method not in ("common", "ceil", "floor"):
        raise TemplateRuntimeError("round: method must be common, ceil or floor")
    if method == "common":
        return round(value, precision)
    return getattr(math, method)(value * 10**precision) / 10**precision


def do_map(value, *args, **kwargs):
    if not args and "attribute" in kwargs:
        attribute, default = kwargs.pop("attribute"), kwargs.pop("default", None)
        if kwargs:
            raise TemplateRuntimeError(f"map: unexpected keyword argument {next(iter(kwargs))!r}")
        func = attribute_getter(attribute, default=default)
    elif args:
        name, rest = args[0], args[1:]
        if name not in FILTERS:
            raise TemplateRuntimeError(f"map: unsupported filter {name!r}")
        func = lambda item: FILTERS[name](item, *rest, **kwargs)  # noqa: E731
    else:
        raise TemplateRuntimeError("map needs a filter name or attribute=")
    return (func(item) for item in value)


def _selector(args: tuple, kwargs: dict, *, by_attribute: bool, keep: bool) -> Callable:
    """Jinja2's prepare_select_or_reject: an optional attribute, then a test name and its arguments."""
    if by_attribute:
        if not args:
            raise TemplateRuntimeError("missing the attribute name")
        transform, args = attribute_getter(args[0]), args[1:]
    else:
        transform = None
    if args:
        name, test_args = args[0], args[1:]
        if name not in TESTS:
            raise TemplateRuntimeError(f"unsupported test {name!r}")
        test = lambda item: TESTS[name](item, *test_args, **kwargs)  # noqa: E731
    else:
        test = bool
    if transform is not None:
        return lambda item: bool(test(transform(item))) == keep
    return lambda item: bool(test(item)) == keep


def _select(by_attribute: bool, keep: bool) -> Callable:
    def select(value, *args, **kwargs):
        if not value:
            return iter(())
        chosen = _selector(args, kwargs, by_attribute=by_attribute, keep=keep)
        return (item for item in value if chosen(item))
    return select


def do_unique(value, case_sensitive=False, attribute=None):
    key = attribute_getter(attribute, postprocess=None if case_sensitive else _ignore_case)
    seen = set()
    for item in value:
        k = key(item)
        if k not in seen:
            seen.add(k)
            yield item


def do_sort(value, reverse=False, case_sensitive=False, attribute=None):
    return sorted(value, key=_sort_key(attribute, case_sensitive), reverse=reverse)


def do_dictsort(value, case_sensitive=False, by="key", reverse=False):
    if by not in ("key", "value"):
        raise TemplateRuntimeError('dictsort: by must be "key" or "value"')
    position = 0 if by == "key" else 1
    key = (lambda item: item[position]) if case_sensitive else (lambda item: _ignore_case(item[position]))
    return sorted(value.items(), key=key, reverse=reverse)


def do_reverse(value):
    if isinstance(value, str):
        return value[::-1]
    try:
        return reversed(value)
    except TypeError:
        items = list(value)
        items.reverse()
        return items


def do_indent(value, width=4, first=False, blank=False):
    indention = width if isinstance(width, str) else " " * width
    lines = (value + "\n").splitlines()  # Jinja2 adds the newline so a trailing one gives an empty last line
    if blank:
        rv = ("\n" + indention).join(lines)
    else:
        rv = lines.pop(0)
        if lines:
            rv += "\n" + "\n".join(indention + line if line else line for line in lines)
    return indention + rv if first else rv


def _min_or_max(func: Callable) -> Callable:
    def aggregate(value, case_sensitive=False, attribute=None):
        items = iter(value)
        first = next(items, _EMPTY)
        if first is _EMPTY:
            return Undefined("No aggregated item, sequence was empty.")
        key = attribute_getter(attribute, postprocess=None if case_sensitive else _ignore_case)
        return func(chain([first], items), key=key)
    return aggregate


def do_sum(value, attribute=None, start=0):
    return sum(map(attribute_getter(attribute), value) if attribute is not None else value, start)


def do_format(value, *args, **kwargs):
    if args and kwargs:
        raise TemplateRuntimeError("format: positional and keyword arguments at the same time")
    return _text(value) % (kwargs or args)


def do_truncate(value, length=255, killwords=False, end="...", leeway=5):
    if len(value) <= length + leeway:
        return value
    if killwords:
        return value[: length - len(end)] + end
    return value[: length - len(end)].rsplit(" ", 1)[0] + end


def do_batch(value, linecount, fill_with=None):
    batch = []
    for item in value:
        if len(batch) == linecount:
            yield batch
            batch = []
        batch.append(item)
    if batch:
        if fill_with is not None and len(batch) < linecount:
            batch += [fill_with] * (linecount - len(batch))
        yield batch


def do_tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


FILTERS: dict[str, Callable[..., Any]] = {
    "abs": abs, "attr": do_attr, "batch": do_batch, "capitalize": lambda s: _text(s).capitalize(),
    "center": lambda s, width=80: _text(s).center(width), "count": len, "d": do_default, "default": do_default,
    "dictsort": do_dictsort, "e": escape, "escape": escape, "first": do_first, "float": do_float, "format": do_format,
    "indent": do_indent, "int": do_int, "items": do_items, "join": do_join, "last": do_last, "length": len,
    "list": list, "lower": lambda s: _text(s).lower(), "map": do_map, "max": _min_or_max(max), "min": _min_or_max(min),
    "reject": _select(False, False), "rejectattr": _select(True, False), "replace": do_replace,
    "reverse": do_reverse, "round": do_round, "safe": Markup, "select": _select(False, True),
    "selectattr": _select(True, True), "sort": do_sort, "string": _text, "sum": do_sum, "title": do_title,
    "tojson": do_tojson, "trim": lambda s, chars=None: _text(s).strip(chars), "truncate": do_truncate,
    "unique": do_unique, "upper": lambda s: _text(s).upper(), "wordcount": lambda s: len(re.findall(r"\w+", _text(s))),
}
