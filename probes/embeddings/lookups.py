"""How a tracked module's lookups are kept: the module under a subclass of its class, or a forward hook.

The ids of each lookup made with autograd on while the collection is armed go to the table's
``lookups``, which TableState.gather takes at the optimizer step. Lookups made without autograd
(evaluation) teach the table nothing and are not kept.
"""

from __future__ import annotations

import copyreg
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from .collection import Embeddings
    from .state import TableState


class Lookups:
    """Keeps the ids of one module's lookups in its table's ``lookups``. The module is put under a subclass
    of its own class whose forward does so, as torch's parametrizations put a module under a subclass, for
    as long as this is on (remove() puts the module's class back). A forward hook did the same through
    torch's hooked module call, which leaves Module.__call__'s fast path: 11-18 us of a 0.9 ms ML-100k
    step for its four lookups, against 3-7 us this way. The subclass keeps its class's name (the model
    prints as before); a copy or a pickle of the module is of its own class again, untracked; a replica's
    lookups (nn.DataParallel) are the table's, as a hook's were. Where the module has a forward of its own
    (set on the instance, as accelerate's hooks do: the class's would not run) or its class takes no
    subclass, a forward hook does it."""

    def __init__(self, module: torch.nn.Module, coll: Embeddings, table: TableState) -> None:
        self.module, self.table, self.coll = module, table, weakref.ref(coll)
        self.base: type | None = None  # the class the module is put under a subclass of, and that subclass
        self.cls: type | None = None
        self._on = [False]  # read by the subclass's forward (each its own): off, it is the class's own
        self._hook: Any = None

    def put_on(self) -> None:
        m = self.module
        # A forward set on the instance (accelerate's hooks set one) would bypass the class's.
        if "forward" in vars(m) or not self._put_class(m):
            self.cls, self._on = None, [False]
            self._hook = m.register_forward_hook(self._on_lookup, with_kwargs=True)
        self._on[0] = True

    def remove(self) -> None:
        self._on[0] = False
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        elif type(self.module) is self.cls:  # else another subclass went on top since: this one stays, off
            self.module.__class__ = self.base

    def _put_class(self, m: torch.nn.Module) -> bool:
        """Put ``m`` under the subclass (made again when its class changed since); False where its class
        takes no subclass (or no other __class__)."""
        try:
            if self.cls is None or type(m) is not self.base:
                self.base, self.cls = type(m), self._subclass(type(m))
            m.__class__ = self.cls
        except TypeError:
            return False
        return True

    def _subclass(self, base: type) -> type:
        # A list of its own: a subclass left under another one's (see remove) stays off for good.
        self._on = on = [False]
        ref, table, base_forward = self.coll, self.table, base.forward

        def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            out = base_forward(self, *args, **kwargs)
            if on[0]:  # kept once the lookup is made: ids it refused never reach the kernel
                keep_lookup(ref, table, args, kwargs)
            return out

        def __reduce_ex__(self: torch.nn.Module, protocol: Any) -> Any:  # copies and pickles: the class's own
            fn, args, *rest = base.__reduce_ex__(self, protocol)
            if fn is copyreg.__newobj__ and args == (cls,):  # (pickle checks that class against __class__)
                return (copyreg._reconstructor, (base, object, None), *rest)  # what protocols 0 and 1 use
            return (fn, tuple(base if a is cls else a for a in args), *rest)

        cls = type(base.__name__, (base,), {"forward": forward, "__reduce_ex__": __reduce_ex__,
                                            "__module__": base.__module__, "__qualname__": base.__qualname__})
        return cls

    def _on_lookup(self, module: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        if self._on[0]:
            keep_lookup(self.coll, self.table, args, kwargs)


def keep_lookup(coll: Callable[[], Embeddings | None], table: TableState, args: tuple, kwargs: dict) -> None:
    """A lookup's ids into its table's ``lookups``, while the collection (``coll``, a weak reference) is
    armed. Lookups made without autograd (evaluation) teach the table nothing. The ids are the first
    argument, passed by position or as ``input=`` (both modules' forward(input, ...)): a lookup by keyword
    missed would leave its rows learning, untracked."""
    if torch.is_grad_enabled():
        c = coll()
        if c is not None and c.armed:
            ids = args[0] if args else kwargs.get("input")
            if isinstance(ids, torch.Tensor):
                table.lookups.append(ids)  # integer ids (no autograd history), flattened in gather()
