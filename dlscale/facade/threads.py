"""Threads that inherit their parent's local properties: PySpark's ``InheritableThread`` and
``inheritable_thread_target``.

A thread's local properties (``setLocalProperty``, the job group and description, the job tags) belong
to it, and a ``threading.Thread`` starts with none, as in PySpark's pinned-thread mode (its default).
``InheritableThread`` copies those of the thread that starts it when ``start()`` is called, and its
target runs with that copy; ``inheritable_thread_target(f)`` copies them when it wraps ``f``, and every
call of the wrapper makes that copy (the same dict, as PySpark sets the same Java ``Properties``) the
calling thread's local properties before calling ``f``. Later changes in one thread are not seen in the
other. Local properties belong to a context: the thread's properties on each context running when the
copy is taken are copied (PySpark runs one context in a process, dlscale may run several); with none
running, these are plain threads and targets.

PySpark's ``session=`` (``InheritableThread``) and session argument (``inheritable_thread_target(session)``)
also copy a session's tags, read with its ``getTags()`` and added in the new thread with ``addTag``:
dlscale has no sessions of its own, but takes any object with those two methods.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from dlscale.facade.context import SparkContext

__all__ = ["InheritableThread", "inheritable_thread_target"]

_Copy = list[tuple[SparkContext, dict[str, str]]]


def _copy_properties() -> _Copy:
    """The running contexts, each with a copy of the calling thread's local properties on it."""
    with SparkContext._lock:
        running = list(SparkContext._running)
    return [(sc, dict(sc._jobs.properties())) for sc in running]


def _apply(copy: _Copy) -> None:
    """Make the copied properties the calling thread's."""
    for sc, props in copy:
        sc._jobs.set_properties(props)


class InheritableThread(threading.Thread):
    """A ``threading.Thread`` whose target runs with a copy of the local properties of the thread that
    called ``start()`` (and, given ``session``, that session's tags as they were then)."""

    def __init__(self, target: Callable[..., Any], *args: Any, session: Any = None, **kwargs: Any) -> None:
        self._session = session
        self._props: _Copy = []
        self._tags: set[str] | None = None

        def copy_local_properties(*a: Any, **k: Any) -> Any:
            if self._tags is not None:
                for tag in self._tags:
                    self._session.addTag(tag)
            _apply(self._props)
            return target(*a, **k)

        super().__init__(*args, target=copy_local_properties, **kwargs)

    def start(self) -> None:
        """Copy the calling thread's local properties (and the session's tags), then start the thread."""
        self._props = _copy_properties()
        if self._session is not None:
            self._tags = set(self._session.getTags())
        super().start()


def inheritable_thread_target(f: Any) -> Callable[..., Any]:
    """Wrap thread target ``f`` so that it runs with a copy of the local properties the calling thread has
    now. Given a session instead (an object with ``getTags`` and ``addTag``), return a decorator that does
    so and also adds the session's present tags in the thread that runs the target."""
    props = _copy_properties()
    if not callable(f):
        session = f
        tags = set(session.getTags())

        def outer(ff: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(ff)
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                _apply(props)
                for tag in tags:
                    session.addTag(tag)
                return ff(*args, **kwargs)

            return wrapped

        return outer

    @functools.wraps(f)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _apply(props)
        return f(*args, **kwargs)

    return wrapped
