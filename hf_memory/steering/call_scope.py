"""A steering is a property of a call, not of the model: the lifecycle every steering shares.

Memory steering and CAA both hook a shared model once and act only for the calls of the context
(thread, asyncio task) that activated them, through a ``contextvars`` variable: an object is
active in the context that created it (unless ``active=False``) until removed, and
:meth:`CallScope.applied` runs a block of calls under it in any other context. Removal is safe
from any thread and idempotent; an object removed elsewhere is inert where it was active.

A steering acts while one of its activations is live (from activation to removal, or for the
``applied()`` block): a context copied from an activated one (an asyncio task, ``copy_context``)
sees it only then. Each kind of steering counts its live activations process-wide
(:class:`InUse`), so the hooks on a shared model skip the context lookup while none is live:
an attribute read that ``torch.compile`` guards on, where it cannot trace ``ContextVar.get``
(a model with steering installed compiles as the plain model does for its plain calls).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from typing import Any, ClassVar

__all__ = ["CallScope", "InUse"]


class InUse:
    """The live activations of one kind of steering, counted over the whole process; ``any``:
    whether there is one (the flag the hooks read before looking up the running call's)."""

    def __init__(self) -> None:
        self.count, self.any = 0, False
        self._lock = threading.Lock()

    def add(self, scope: CallScope, change: int) -> None:
        """``change`` live activations of ``scope`` (its own count moves with the total)."""
        with self._lock:
            scope._live += change
            self.count += change
            self.any = self.count > 0


class CallScope:
    """Activation in a context, ``applied()`` blocks, idempotent removal, ``with`` support.

    Subclasses name their context variable (``variable``) and live-activation count
    (``in_use``), say what activating does to the variable's value (:meth:`_activated`: replace
    it, or stack onto it), call :meth:`_begin` when ready and :meth:`_end` from ``remove()``;
    their hooks act for a value found in the variable only while it is :attr:`live`.
    """

    variable: ClassVar[ContextVar]
    in_use: ClassVar[InUse]
    # not live until activated: a subclass's hooks can run in other threads' calls before
    # its __init__ reaches _begin
    _live = 0
    what: ClassVar[str] = "steering"  # for the error after removal

    def _activated(self, current: Any) -> Any:
        """The variable's value while this object is active (default: this object alone)."""
        return self

    @property
    def live(self) -> bool:
        """Whether an activation of this object is live now (in some context)."""
        return self._live > 0

    def _begin(self, active: bool) -> None:
        self._removed, self._live = False, 0
        self._token: Token | None = None
        if active:
            self.in_use.add(self, 1)
            self._token = self.variable.set(self._activated(self.variable.get()))

    @contextmanager
    def applied(self) -> Iterator[Any]:
        """Run the calls inside the block under this object, in whatever context runs it (the
        context's previous value comes back after)."""
        if self._removed:
            raise RuntimeError(f"this {self.what} was removed")
        self.in_use.add(self, 1)
        token = self.variable.set(self._activated(self.variable.get()))
        try:
            yield self
        finally:
            self.variable.reset(token)
            self.in_use.add(self, -1)

    def _end(self) -> bool:
        """Deactivate in the creating context; False if this object was already removed."""
        if self._removed:
            return False
        self._removed = True
        if self._token is not None:
            self.in_use.add(self, -1)
            try:
                self.variable.reset(self._token)
            except ValueError:
                pass  # removed from another context: the object left there is inert (_removed)
            self._token = None
        return True

    def remove(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()
