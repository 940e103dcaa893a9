"""One registry per plug point: names for threshold algorithms, residual post-processors, gradient
sharing's compressors, evaluation types, losses, network factories, minibatch loaders and the pages a
context adds to Dask's dashboard.

Each kind of plug-in has one :class:`Registry` (fsspec's implementation registry is the model): the
built-ins are registered when their module is imported, a program adds its own with
:func:`register`, and an installed distribution offers them through the entry-point group
``dlscale.<kind>`` (``dlscale.loss``, ``dlscale.threshold_algorithm``, ...), which is read only when
a name is not registered already::

    from dlscale import registry

    registry.register("loss", "focal", focal_loss)        # in code
    registry.resolve("threshold_algorithm", "adaptive", initial_threshold=1e-2)

    # or in the plug-in's pyproject.toml:
    # [project.entry-points."dlscale.loss"]
    # focal = "mypackage.losses:focal_loss"

A name that is taken is refused unless ``clobber=True`` (registering the very same object again is
allowed and changes nothing), so a plug-in never silently replaces a built-in.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from dlscale.errors import DlscaleError

T = TypeVar("T")

ENTRY_POINT_PREFIX = "dlscale."
"""A kind's plug-ins are declared in the entry-point group ``dlscale.<kind>``."""

_HOMES = {
    "threshold_algorithm": "dlscale.encoding.thresholds",
    "residual_post_processor": "dlscale.encoding.residual",
    "compressor": "dlscale.encoding.registry",
    "evaluation": "dlscale.evaluation._base",
    "loss": "dlscale.nn.losses",
    "model_factory": "dlscale.nn.archive",
    "loader": "dlscale.data.loaders",
    "dashboard_page": "dlscale.monitor.panel",
}
"""Where each kind's registry lives (its module's ``REGISTRY``), imported when first asked for."""

KINDS = tuple(_HOMES)
"""The kinds of plug-in dlscale knows."""


class NameTakenError(DlscaleError, ValueError):
    """A plug-in registered under a name that another object already has (without ``clobber=True``)."""


class UnknownNameError(DlscaleError, ValueError):
    """A name that is neither registered nor offered by an installed plug-in."""


class PluginImportError(DlscaleError, ImportError):
    """An installed plug-in's entry point that cannot be loaded."""


class Registry(Generic[T]):
    """Plug-ins of one ``kind``, by name.

    ``base`` is what the kind's objects are: :meth:`register` takes a subclass of it (made with
    keyword arguments by :meth:`resolve`) or an instance of it (used as it is); :meth:`resolve`
    passes an instance through. The names are read through :attr:`view`, a read-only mapping.
    ``noun`` names the kind in messages (default: ``kind`` with spaces for underscores).
    """

    def __init__(self, kind: str, base: type, noun: str | None = None, builtins: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self.builtins = builtins
        """Modules that register built-ins of the kind as they are imported: imported before a name is
        looked up or listed (packages import their modules lazily)."""
        self.base = base
        self.noun = noun or kind.replace("_", " ")
        self.group = ENTRY_POINT_PREFIX + kind
        self._entries: dict[str, Any] = {}
        self._lock = threading.RLock()  # loading a plug-in may register more of the same kind
        self.view: Mapping[str, Any] = MappingProxyType(self._entries)
        """The registered names and objects, read-only (plug-ins not yet asked for are not in it)."""

    def register(self, name: str, obj: Any, clobber: bool = False) -> None:
        """Register ``obj`` as ``name``; a name already taken by another object is refused unless
        ``clobber``, and registering the same object again does nothing."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"a {self.noun} is registered under a non-empty string, not {name!r}")
        if not self._fits(obj):
            raise TypeError(f"{self.noun} {name!r}: {obj!r} is not a {self._base_name()} or a subclass of one")
        with self._lock:
            taken = self._entries.get(name)
            if taken is not None and taken is not obj and not clobber:
                raise NameTakenError(
                    f"{self.noun} {name!r} is already registered as {taken!r}; "
                    f"pass clobber=True to replace it with {obj!r}"
                )
            self._entries[name] = obj

    def lookup(self, name: str) -> Any:
        """The object registered as ``name``, loading an installed plug-in of that name if need be."""
        if not isinstance(name, str):
            raise UnknownNameError(f"{self.noun} names are strings, not {type(name).__name__} {name!r}")
        found = self._entries.get(name)
        if found is not None:
            return found
        self.import_builtins()  # outside the lock: a module being imported registers under it
        with self._lock:
            if name not in self._entries:
                self._load_plugin(name)
            return self._entries[name]

    def resolve(self, spec: Any, **kwargs: Any) -> T:
        """``spec`` itself if it is an instance of the kind; else the object registered as ``spec``,
        made with ``kwargs`` if it is a class."""
        if isinstance(spec, self.base) and not isinstance(spec, type):
            if kwargs:
                raise TypeError(f"keyword arguments {sorted(kwargs)} go with a {self.noun}'s name, not an instance")
            return spec
        if not isinstance(spec, str):
            raise TypeError(f"a {self.noun} is a {self._base_name()} or a registered name, not {type(spec).__name__}")
        obj = self.lookup(spec)
        if isinstance(obj, type):
            return obj(**kwargs)
        if kwargs:
            raise TypeError(f"{self.noun} {spec!r} is an instance; it takes no keyword arguments {sorted(kwargs)}")
        return obj

    def names(self) -> list[str]:
        """Every name that resolves: the registered ones and those installed plug-ins offer."""
        self.import_builtins()
        return sorted(set(self._entries) | {ep.name for ep in self._entry_points()})

    def import_builtins(self) -> None:
        """Import :attr:`builtins` (nothing once they are imported)."""
        for module in self.builtins:
            importlib.import_module(module)

    def _load_plugin(self, name: str) -> None:
        found = {ep.value: ep for ep in self._entry_points() if ep.name == name}
        if not found:
            raise UnknownNameError(
                f"unknown {self.noun} {name!r}; known: {', '.join(self.names()) or 'none'} "
                f"(plug-ins register with dlscale.registry.register or the entry-point group {self.group!r})"
            )
        if len(found) > 1:
            raise NameTakenError(
                f"{self.noun} {name!r} is offered by several installed plug-ins: "
                + ", ".join(f"{value} ({_distribution(ep)})" for value, ep in sorted(found.items()))
            )
        (ep,) = found.values()
        try:
            obj = ep.load()
        except Exception as e:
            raise PluginImportError(
                f"{self.noun} {name!r} from {_distribution(ep)} (entry point {name} = {ep.value} in group "
                f"{self.group!r}) cannot be loaded: {type(e).__name__}: {e}"
            ) from e
        self.register(name, obj)

    def _entry_points(self) -> list[importlib.metadata.EntryPoint]:
        return list(importlib.metadata.entry_points(group=self.group))

    def _fits(self, obj: Any) -> bool:
        return issubclass(obj, self.base) if isinstance(obj, type) else isinstance(obj, self.base)

    def _base_name(self) -> str:
        return getattr(self.base, "__name__", repr(self.base))

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {len(self._entries)} registered)"


def _distribution(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"distribution {dist.name}" if dist is not None else "an installed distribution"


def get(kind: str) -> Registry:
    """The registry of ``kind`` (one of :data:`KINDS`)."""
    home = _HOMES.get(kind)
    if home is None:
        raise UnknownNameError(f"unknown kind of plug-in {kind!r}; known: {', '.join(KINDS)}")
    found = importlib.import_module(home).REGISTRY
    found.import_builtins()
    return found


def register(kind: str, name: str, obj: Any, clobber: bool = False) -> None:
    """Register ``obj`` as the ``kind`` plug-in ``name`` (see :meth:`Registry.register`)."""
    get(kind).register(name, obj, clobber)


def resolve(kind: str, spec: Any, **kwargs: Any) -> Any:
    """The ``kind`` plug-in ``spec`` names, made with ``kwargs`` (see :meth:`Registry.resolve`)."""
    return get(kind).resolve(spec, **kwargs)
