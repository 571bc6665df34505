"""`BoundedCache`: the one kind of process-wide cache the library keeps, explicit and bounded.

Used for objects that must be recognised across `generate` calls (default policies, policies built
from a calibration, compiled layer blocks) and for once-per-process warnings. Least recently used
entries are dropped past `maxsize`; whoever needs an object to stay alive (a captured graph) holds
its own reference.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, TypeVar

T = TypeVar("T")


class BoundedCache:
    def __init__(self, maxsize: int):
        if maxsize < 1:
            raise ValueError(f"maxsize must be positive, got {maxsize}")
        self.maxsize = maxsize
        self._items: OrderedDict = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Hashable, build: Callable[[], T]) -> T:
        """The entry for `key`, built by `build()` when absent."""
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = self._items[key] = build()
        while len(self._items) > self.maxsize:
            self._items.popitem(last=False)
        return value

    def first_time(self, key: Hashable) -> bool:
        """True the first time `key` is seen (among the last `maxsize` keys): say-once warnings."""
        seen = key in self._items
        self.get(key, lambda: True)
        return not seen

    def clear(self) -> None:
        self._items.clear()


# compiled layer blocks: one entry per kind of blocks (the target's, the drafter's)
_COMPILED_BLOCKS = BoundedCache(4)


def compiled_once(blocks: type, options: dict) -> tuple:
    """An instance of the NamedTuple class `blocks` whose fields are its default functions compiled
    with `torch.compile(dynamic=False)`, built once per process: every user shares the compiled
    functions, so dynamo compiles each layer kind once (regional compilation: the functions take
    the layer module as an argument, whose parameters are graph inputs), with inductor `options`
    (`hybridspec.ops.dispatch.layer_options()`)."""
    import torch

    return _COMPILED_BLOCKS.get((blocks, tuple(sorted(options.items()))), lambda: blocks(
        *(torch.compile(f, dynamic=False, options=options) for f in blocks._field_defaults.values())))


def compiled_copy(fn, options: dict):
    """`fn` compiled as one fullgraph region (`torch.compile(dynamic=False)`, inductor `options`) on a
    copy of its code object. Dynamo keeps compiled code, and counts recompiles, per code object: the
    users of one function (every runner of a process, each with its own shapes) would all be
    recompiles of it, and with fullgraph the ninth fails (`recompile_limit` is 8). With its own copy
    each user compiles once, however many a process builds. Fullgraph: a change that breaks the
    trace fails at the first call instead of splitting the region."""
    import types

    import torch

    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return torch.compile(own, dynamic=False, fullgraph=True, options=options)
