"""A tensor that records the torch operations applied to it, to show a reader only slices what it needs."""

from __future__ import annotations

import torch

# Calls that read no element (shape and dtype queries).
_METADATA = {"__get__", "dim", "size", "stride", "is_contiguous", "__len__", "numel"}


class Spy(torch.Tensor):
    """``Spy.wrap(t)``: ``t`` whose every torch call is logged in ``.calls`` as (name, other arguments); what
    the calls return are plain tensors, so only operations on the whole tensor are logged."""

    calls: list

    @staticmethod
    def wrap(t: torch.Tensor) -> Spy:
        spy = t.as_subclass(Spy)
        spy.calls = []
        return spy

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for arg in args:
            if isinstance(arg, Spy) and hasattr(arg, "calls"):
                arg.calls.append((getattr(func, "__name__", str(func)), args[1:] if arg is args[0] else args))
        return _plain(super().__torch_function__(func, types, args, kwargs or {}))

    def reads(self) -> list:
        """The logged calls that touch elements."""
        return [call for call in self.calls if call[0] not in _METADATA]


def _plain(x):
    if isinstance(x, Spy):
        return torch.Tensor.as_subclass(x, torch.Tensor)
    if isinstance(x, (tuple, list)):
        return type(x)(_plain(v) for v in x)
    return x


def row_slice(start: int, stop: int) -> list:
    """The only read a rows reader may make of a whole tensor: ``t[start:stop]``."""
    return [("__getitem__", (slice(start, stop, None),))]
