"""The values a template works with beyond plain data, and how it may touch data, as in Jinja2's runtime.py,
utils.py and sandbox.py under ImmutableSandboxedEnvironment:

- ``Undefined``: Jinja2's default undefined. Prints as "", is falsy, iterates as empty, has length 0 and
  equals only another Undefined; arithmetic, comparison, attribute or item access and calls raise.
- ``x.name`` tries the attribute first, then ``x["name"]``; ``x[key]`` the item first, then the attribute; a
  miss is Undefined. Attributes starting with "_" and methods that change a list, dict or set (``append``,
  ``update``, ``pop``...) are refused: reading gives an Undefined that raises the sandbox's error when used.
- ``Namespace`` (``namespace(...)``), ``LoopContext`` (``loop``), ``Markup`` (``safe`` / ``escape`` results).
"""

from __future__ import annotations

import string
from _string import formatter_field_name_split  # the standard library's own parser of "0.attr[key]"
from collections import abc
from typing import Any

from runtime.tokenizer.chat.errors import SecurityError, UndefinedError

MISSING = object()
MAX_RANGE = 100_000  # Jinja2's sandbox refuses longer ranges

# sandbox.py's _mutable_spec: methods that change a value, refused by the immutable sandbox.
_MUTATING = ((abc.MutableSet, frozenset({"add", "clear", "difference_update", "discard", "pop", "remove",
                                         "symmetric_difference_update", "update"})),
             (abc.MutableMapping, frozenset({"clear", "pop", "popitem", "setdefault", "update"})),
             (abc.MutableSequence, frozenset({"append", "clear", "pop", "reverse", "insert", "sort", "extend",
                                              "remove"})))
_DICT_ATTRIBUTES = frozenset(dir(dict))


def type_repr(obj: object) -> str:
    """Jinja2's object_type_repr: 'dict object', 'None'."""
    if obj is None:
        return "None"
    cls = type(obj)
    return f"{cls.__name__} object" if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__name__} object"


class Undefined:
    __slots__ = ("hint", "obj", "name", "exc")

    def __init__(self, hint: str | None = None, *, obj: object = MISSING, name: object = None,
                 exc: type[Exception] = UndefinedError):
        self.hint, self.obj, self.name, self.exc = hint, obj, name, exc

    @property
    def message(self) -> str:
        if self.hint:
            return self.hint
        if self.obj is MISSING:
            return f"{self.name!r} is undefined"
        if not isinstance(self.name, str):
            return f"{type_repr(self.obj)} has no element {self.name!r}"
        return f"{type_repr(self.obj)!r} has no attribute {self.name!r}"

    def fail(self, *args: Any, **kwargs: Any):
        raise self.exc(self.message)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = fail
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = fail
    __pos__ = __neg__ = __call__ = __getitem__ = fail
    __lt__ = __le__ = __gt__ = __ge__ = __int__ = __float__ = __complex__ = __pow__ = __rpow__ = fail

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        self.fail()

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __ne__(self, other: object) -> bool:
        return type(self) is not type(other)

    def __hash__(self) -> int:
        return id(type(self))

    def __str__(self) -> str:
        return ""

    def __len__(self) -> int:
        return 0

    def __iter__(self):
        return iter(())

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "Undefined"


class Namespace:
    """``namespace(a=1)``: the one object ``{% set ns.a = ... %}`` may change."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.attrs = dict(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Namespace {self.attrs!r}>"


class LoopContext:
    """``loop`` in a for body (Jinja2's LoopContext, without recursion: depth is always 1)."""

    depth, depth0 = 1, 0

    def __init__(self, items: list):
        self._items, self.length, self.index0 = items, len(items), -1
        self._last_changed: object = MISSING

    index = property(lambda self: self.index0 + 1)
    revindex = property(lambda self: self.length - self.index0)
    revindex0 = property(lambda self: self.length - self.index0 - 1)
    first = property(lambda self: self.index0 == 0)
    last = property(lambda self: self.index0 == self.length - 1)

    @property
    def previtem(self):
        return self._items[self.index0 - 1] if self.index0 > 0 else Undefined("there is no previous item")

    @property
    def nextitem(self):
        return self._items[self.index0 + 1] if self.index0 + 1 < self.length else Undefined("there is no next item")

    def cycle(self, *args: Any):
        if not args:
            raise TypeError("no items for cycling given")
        return args[self.index0 % len(args)]

    def changed(self, *value: Any) -> bool:
        if value != self._last_changed:
            self._last_changed = value
            return True
        return False

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        return f"<LoopContext {self.index}/{self.length}>"


class Markup(str):
    """markupsafe's Markup as far as templates can see it without autoescape: text marked safe, which
    escapes plain strings added to it."""

    def __add__(self, other):
        return Markup(str.__add__(self, escape(other))) if isinstance(other, str) else NotImplemented

    def __radd__(self, other):
        return Markup(str.__add__(escape(other), self)) if isinstance(other, str) else NotImplemented

    def __html__(self) -> str:
        return self


def escape(value: object) -> Markup:
    """markupsafe.escape: & < > ' " as HTML entities, unless the value is already Markup."""
    if hasattr(value, "__html__"):
        return Markup(value.__html__())
    text = str(value)
    for char, entity in (("&", "&amp;"), (">", "&gt;"), ("<", "&lt;"), ("'", "&#39;"), ('"', "&#34;")):
        text = text.replace(char, entity)
    return Markup(text)


def safe_attribute(obj: object, name: str) -> bool:
    if name.startswith("_"):
        return False
    return not any(isinstance(obj, kind) and name in names for kind, names in _MUTATING)


def _unsafe(obj: object, name: str) -> Undefined:
    return Undefined(f"access to attribute {name!r} of {type(obj).__name__!r} object is unsafe.", obj=obj, name=name,
                     exc=SecurityError)


def get_attribute(obj: object, name: str) -> Any:
    """``obj.name``: the attribute, else the item, else Undefined (Jinja2's sandboxed getattr)."""
    if type(obj) is dict and name not in _DICT_ATTRIBUTES:  # the common case, ``message.role``, without an exception
        return obj[name] if name in obj else Undefined(obj=obj, name=name)
    if isinstance(obj, Namespace):
        return obj.attrs.get(name, Undefined(obj=obj, name=name))
    if isinstance(obj, Undefined):
        obj.fail()
    try:
        value = getattr(obj, name)
    except AttributeError:
        try:
            return obj[name]
        except (TypeError, LookupError):
            return Undefined(obj=obj, name=name)
    return value if safe_attribute(obj, name) else _unsafe(obj, name)


def get_item(obj: object, key: object) -> Any:
    """``obj[key]``: the item, else (for a string key) the attribute, else Undefined (Jinja2's sandboxed getitem)."""
    if isinstance(obj, Undefined):
        obj.fail()
    if isinstance(obj, Namespace):
        return obj.attrs.get(key, Undefined(obj=obj, name=key))
    try:
        return obj[key]
    except (TypeError, LookupError):
        if isinstance(key, str):
            try:
                value = getattr(obj, key)
            except AttributeError:
                pass
            else:
                return value if safe_attribute(obj, key) else _unsafe(obj, key)
    return Undefined(obj=obj, name=key)


class _SandboxedFormatter(string.Formatter):
    """``str.format`` whose ``{0.attr}`` / ``{0[key]}`` fields go through the sandbox (Jinja2's SandboxedFormatter)."""

    def get_field(self, field_name: str, args, kwargs):
        first, rest = formatter_field_name_split(field_name)
        obj = self.get_value(first, args, kwargs)
        for is_attribute, key in rest:
            obj = get_attribute(obj, key) if is_attribute else get_item(obj, key)
        return obj, first


def call(func: object, args: list, kwargs: dict) -> Any:
    """A call from the template: ``str.format`` / ``format_map`` sandboxed, everything else as Python calls it."""
    self = getattr(func, "__self__", None)
    if isinstance(self, str) and getattr(func, "__name__", None) in ("format", "format_map"):
        if func.__name__ == "format_map":
            if len(args) != 1 or kwargs:
                raise TypeError("format_map() takes exactly one argument")
            return _SandboxedFormatter().vformat(self, (), args[0])
        return _SandboxedFormatter().vformat(self, args, kwargs)
    return func(*args, **kwargs)


def safe_range(*args: int) -> range:
    rng = range(*args)
    if len(rng) > MAX_RANGE:
        raise OverflowError(f"range too big: the sandbox allows at most {MAX_RANGE} items")
    return rng
