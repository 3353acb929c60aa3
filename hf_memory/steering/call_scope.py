"""A steering is a property of a call, not of the model: the lifecycle every steering shares.

Memory steering and CAA both hook a shared model once and act only for the calls of the context
(thread, asyncio task) that activated them, through a ``contextvars`` variable: an object is
active in the context that created it (unless ``active=False``) until removed, and
:meth:`CallScope.applied` runs a block of calls under it in any other context. Removal is safe
from any thread and idempotent; an object removed elsewhere is inert where it was active.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from typing import Any, ClassVar

__all__ = ["CallScope"]


class CallScope:
    """Activation in a context, ``applied()`` blocks, idempotent removal, ``with`` support.

    Subclasses name their context variable (``variable``) and say what activating does to its
    value (:meth:`_activated`: replace it, or stack onto it); they call :meth:`_begin` when
    ready and :meth:`_end` from ``remove()``.
    """

    variable: ClassVar[ContextVar]
    what: ClassVar[str] = "steering"  # for the error after removal

    def _activated(self, current: Any) -> Any:
        """The variable's value while this object is active (default: this object alone)."""
        return self

    def _begin(self, active: bool) -> None:
        self._removed = False
        self._token: Token | None = (self.variable.set(self._activated(self.variable.get()))
                                     if active else None)

    @contextmanager
    def applied(self) -> Iterator[Any]:
        """Run the calls inside the block under this object, in whatever context runs it (the
        context's previous value comes back after)."""
        if self._removed:
            raise RuntimeError(f"this {self.what} was removed")
        token = self.variable.set(self._activated(self.variable.get()))
        try:
            yield self
        finally:
            self.variable.reset(token)

    def _end(self) -> bool:
        """Deactivate in the creating context; False if this object was already removed."""
        if self._removed:
            return False
        self._removed = True
        if self._token is not None:
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
