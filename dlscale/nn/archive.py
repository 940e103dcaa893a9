"""The network archive: parameters, optimizer state and configuration in one pickle-free file.

A zip archive (entries stored, not compressed) with two members:

- ``network.json``: format name and version, the loss (a name), the optimizer (a ``torch.optim``
  class name and its keyword arguments), the registered factory that rebuilds the module and its
  keyword arguments, the parameter count and dtype, the iteration and epoch counters, user
  metadata, and the optimizer state's structure with every tensor replaced by a reference;
- ``tensors.bin``: the parameter vector, then the optimizer state's tensors, as raw little-endian
  bytes, each described (dtype, shape, offset) in ``network.json`` and covered by a CRC-32C.

Loading reads JSON and raw bytes only; the module is rebuilt either from ``module=`` or from a
factory that the program registered with :func:`model_factory`, never from anything the archive
itself could name into existence, so a crafted archive cannot run code. Every field of
``network.json`` is checked before it is used, and a member stored compressed (dlscale stores them
as they are) inflates to no more than ``dlscale.nn.max-inflated-bytes``: a crafted archive is
refused with a :class:`CorruptDataError` naming it and the field or member at fault.
"""

from __future__ import annotations

import functools
import inspect
import io
import json
import zipfile
from collections.abc import Callable
from typing import Any

import crc32c
import torch
from dask.utils import parse_bytes

from dlscale import __version__, config, storage
from dlscale.data.format import DTYPES, raw_bytes, tensor_at
from dlscale.errors import CorruptDataError, StorageError
from dlscale.nn import losses
from dlscale.nn.network import Network
from dlscale.registry import Registry, UnknownNameError

FORMAT = "dlscale-network"
VERSION = 1
MEMBERS = ("network.json", "tensors.bin")
_NAMES = {v: k for k, v in DTYPES.items()}
REGISTRY: Registry[Callable[..., torch.nn.Module]] = Registry("model_factory", Callable, "network factory")
"""Network factories by ``<module>:<qualified name>``; an installed plug-in offers one under that name
in the entry-point group ``dlscale.model_factory``."""


def model_factory(fn: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    """Register ``fn`` (keyword arguments -> module) as ``<module>:<qualified name>`` so that archives
    can name it to rebuild a module. Defining it again (its module run again) replaces the earlier one."""
    name = f"{fn.__module__}:{fn.__qualname__}"
    REGISTRY.register(name, fn, clobber=True)
    fn.factory_name = name  # type: ignore[attr-defined]
    return fn


def build(
    factory: Callable[..., torch.nn.Module], kwargs: dict[str, Any], loss: str | losses.LossFn, optimizer: Any = None
) -> Network:
    """A Network whose module is ``factory(**kwargs)``, remembered so that its archive can rebuild it."""
    name = getattr(factory, "factory_name", None)
    if name is None or REGISTRY.view.get(name) is not factory:
        raise ValueError(f"{factory!r} is not registered: decorate it with @dlscale.nn.model_factory")
    _json_ready(kwargs, f"the arguments of {name}")
    network = Network(factory(**kwargs), loss, optimizer)
    network.factory = (name, dict(kwargs))
    return network


def _json_ready(value: Any, what: str) -> None:
    try:
        json.dumps(value, allow_nan=True)
    except TypeError as e:
        raise TypeError(f"{what} must be JSON values (numbers, strings, lists, dicts) to be archived: {e}") from e


def _optimizer_spec(factory: Any) -> dict | None:
    """``{"class": name, "kwargs": {...}}`` for ``functools.partial(torch.optim.X, ...)``, else None."""
    if not isinstance(factory, functools.partial) or factory.args:
        return None
    cls = factory.func
    if not (
        isinstance(cls, type)
        and issubclass(cls, torch.optim.Optimizer)
        and getattr(torch.optim, cls.__name__, None) is cls
    ):
        return None
    kwargs = {k: list(v) if isinstance(v, tuple) else v for k, v in factory.keywords.items()}
    try:
        json.dumps(kwargs)
    except TypeError:
        return None
    return {"class": cls.__name__, "kwargs": kwargs}


class _Tensors:
    """Collects tensors into one blob, replacing them in a structure by ``{"tensor": i}``."""

    def __init__(self) -> None:
        self.entries: list[dict] = []
        self.parts: list[bytes] = []
        self.offset = 0

    def add(self, t: torch.Tensor) -> dict:
        data = raw_bytes(t, "a tensor of the network").tobytes()
        self.entries.append(
            {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "offset": self.offset, "nbytes": len(data)}
        )
        self.parts.append(data)
        self.offset += len(data)
        return {"tensor": len(self.entries) - 1}

    def encode(self, value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            return self.add(value)
        if isinstance(value, dict):
            return {"dict": [[self.encode(k, where), self.encode(v, f"{where}.{k}")] for k, v in value.items()]}
        if isinstance(value, (list, tuple)):
            return {"list": [self.encode(v, where) for v in value]}
        if value is None or isinstance(value, (bool, int, float, str)):
            return {"value": value}
        raise TypeError(f"cannot archive {where}: a {type(value).__name__}")


def _decode(value: Any, tensors: list[torch.Tensor]) -> Any:
    """The structure :meth:`_Tensors.encode` wrote; a malformed one raises KeyError, IndexError or TypeError."""
    if not isinstance(value, dict):
        raise TypeError(f"a {type(value).__name__} where an encoded value was expected")
    if "tensor" in value:
        return tensors[value["tensor"]]
    if "dict" in value:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value["dict"]}
    if "list" in value:
        return [_decode(v, tensors) for v in value["list"]]
    return value["value"]


def save(
    network: Network,
    url: str,
    save_updater: bool = True,
    storage_options: dict[str, Any] | None = None,
    *,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write ``network`` to ``url`` atomically, with its optimizer state when ``save_updater``; ``extra`` (plain
    JSON data, e.g. a checkpoint's fit position) is kept beside it and read by :func:`load_with_extra`."""
    tensors = _Tensors()
    tensors.add(network.params())
    state = None
    if save_updater and network.optimizer is not None:
        state = tensors.encode(network.optimizer_state(), "optimizer state")
    _json_ready(network.metadata, "network.metadata")
    blob = b"".join(tensors.parts)
    factory = network.factory
    header = {
        "format": FORMAT,
        "version": VERSION,
        "dlscale": __version__,
        "loss": network.loss if isinstance(network.loss, str) else None,
        "optimizer": _optimizer_spec(network.optimizer_factory),
        "factory": {"name": factory[0], "kwargs": factory[1]} if factory else None,
        "module": type(network.module).__name__,
        "num_params": network.num_params(),
        "iteration": network.iteration,
        "epoch": network.epoch,
        "optimizer_state": state,
        "tensors": tensors.entries,
        "crc32c": crc32c.crc32c(blob),
        "metadata": network.metadata,
    }
    if extra is not None:
        _json_ready(extra, "extra")
        header["extra"] = extra
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("network.json", json.dumps(header))
        z.writestr("tensors.bin", blob)
    storage.write_bytes(url, out.getbuffer(), storage_options=storage_options)


_REQUIRED = object()
_KIND_NAMES = {
    type(None): "null",
    bool: "a boolean",
    int: "an integer",
    str: "a string",
    dict: "an object",
    list: "a list",
}


def _field(obj: dict, key: str, kinds: tuple[type, ...], url: str, where: str = "", default: Any = _REQUIRED) -> Any:
    """``obj[key]`` if it is one of ``kinds`` (JSON's types; a boolean is not an integer), else a
    :class:`CorruptDataError` naming ``url`` and the field (``where`` + ``key``)."""
    name = f"{where}{key}"
    if key not in obj:
        if default is _REQUIRED:
            raise CorruptDataError(f"{url}: network.json has no {name!r} field")
        return default
    value = obj[key]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        expected = " or ".join(_KIND_NAMES[k] for k in kinds)
        raise CorruptDataError(f"{url}: network.json field {name!r} is {value!r}, expected {expected}")
    return value


def _check_header(header: Any, url: str) -> dict:
    """``header`` with every field checked: a missing or mistyped one raises :class:`CorruptDataError`."""
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CorruptDataError(f"{url}: not a dlscale network archive")
    version = _field(header, "version", (int,), url)
    if version > VERSION:
        raise CorruptDataError(
            f"{url}: written in archive version {version}; this dlscale reads up to version {VERSION}"
        )
    _field(header, "crc32c", (int,), url)
    if _field(header, "num_params", (int,), url) < 1:
        raise CorruptDataError(f"{url}: network.json field 'num_params' is {header['num_params']}, expected at least 1")
    for key in ("iteration", "epoch"):
        _field(header, key, (int,), url, default=0)
    _field(header, "loss", (str, type(None)), url, default=None)
    _field(header, "metadata", (dict,), url, default={})
    _field(header, "optimizer_state", (dict, type(None)), url, default=None)
    for key, name in (("factory", "name"), ("optimizer", "class")):
        spec = _field(header, key, (dict, type(None)), url, default=None)
        if spec is not None:
            _field(spec, name, (str,), url, f"{key}.")
            _field(spec, "kwargs", (dict,), url, f"{key}.")
    entries = _field(header, "tensors", (list,), url)
    if not entries:
        raise CorruptDataError(f"{url}: network.json field 'tensors' is empty; the parameters are its first entry")
    for i, entry in enumerate(entries):
        where = f"tensors[{i}]."
        if not isinstance(entry, dict):
            raise CorruptDataError(f"{url}: network.json field 'tensors[{i}]' is {entry!r}, expected an object")
        _field(entry, "dtype", (str,), url, where)
        for key in ("offset", "nbytes"):
            _field(entry, key, (int,), url, where)
        shape = _field(entry, "shape", (list,), url, where)
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise CorruptDataError(
                f"{url}: network.json field '{where}shape' is {shape!r}, expected a list of integers"
            )
    return header


def _read_member(z: zipfile.ZipFile, name: str, url: str) -> bytes:
    """Member ``name``'s bytes, inflating no more than its declared size (a member that holds more
    fails zipfile's CRC-32 check after that many bytes)."""
    info = z.getinfo(name)
    try:
        with z.open(info) as f:
            data = f.read(info.file_size)
    except zipfile.BadZipFile as e:
        raise CorruptDataError(
            f"{url}: member {name} holds other bytes than its declared {info.file_size} ({e})"
        ) from e
    if len(data) != info.file_size:
        raise CorruptDataError(f"{url}: member {name} is truncated: {len(data)} of {info.file_size} bytes")
    return data


def _read(url: str, storage_options: dict[str, Any] | None) -> tuple[dict, bytes]:
    fs, path = storage.open_fs(url, storage_options)
    try:
        with fs.open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError as e:
        raise StorageError(f"network archive not found: {url}") from e
    except Exception as e:
        raise StorageError(f"cannot read network archive {url}: {e}") from e
    limit = parse_bytes(config.get("nn.max-inflated-bytes"))
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            infos = [z.getinfo(name) for name in MEMBERS]
            inflated = sum(i.file_size for i in infos if i.compress_type != zipfile.ZIP_STORED)
            if inflated > limit:
                raise CorruptDataError(
                    f"{url}: its compressed members declare {inflated} bytes, more than the {limit} a network "
                    "archive may inflate to (dlscale.nn.max-inflated-bytes)"
                )
            raw_header, blob = (_read_member(z, name, url) for name in MEMBERS)
        header = json.loads(raw_header)
    except (zipfile.BadZipFile, KeyError, ValueError, EOFError, NotImplementedError, RuntimeError) as e:
        if isinstance(e, CorruptDataError):
            raise
        raise CorruptDataError(f"{url}: not a dlscale network archive ({e})") from e
    header = _check_header(header, url)
    if crc32c.crc32c(blob) != header["crc32c"]:
        raise CorruptDataError(f"{url}: tensor data checksum mismatch (the archive is corrupt)")
    return header, blob


def _tensors(header: dict, blob: bytes, url: str) -> list[torch.Tensor]:
    buf = bytearray(blob)  # writable: the parameters are copied out, optimizer state tensors used as they are
    tensors = []
    for i, entry in enumerate(header["tensors"]):
        try:
            tensors.append(tensor_at(buf, entry))
        except ValueError as e:
            raise CorruptDataError(f"{url}: network.json field 'tensors[{i}]' is inconsistent: {e}") from e
    if tensors[0].shape != (header["num_params"],):
        raise CorruptDataError(
            f"{url}: network.json field 'tensors[0]' (the parameters) has shape {tuple(tensors[0].shape)}, "
            f"but 'num_params' is {header['num_params']}"
        )
    return tensors


def _module(header: dict, url: str) -> torch.nn.Module:
    """The module rebuilt by the registered factory the archive names."""
    spec = header.get("factory")
    if spec is None:
        raise ValueError(f"{url} records no factory for its {header.get('module')} module: pass module=")
    try:
        factory = REGISTRY.lookup(spec["name"])
    except UnknownNameError:
        raise UnknownNameError(
            f"{url} names factory {spec['name']!r}, which is not registered in this process: "
            "import the module that defines it (decorated with @dlscale.nn.model_factory), install a "
            f"plug-in that offers it in the entry-point group {REGISTRY.group!r}, or pass module="
        ) from None
    try:
        inspect.signature(factory).bind(**spec["kwargs"])
    except TypeError as e:
        raise CorruptDataError(
            f"{url}: network.json field 'factory.kwargs' does not fit factory {spec['name']!r}: {e}"
        ) from e
    return factory(**spec["kwargs"])


def _optimizer(spec: dict, url: str) -> functools.partial:
    """``functools.partial(torch.optim.<class>, **kwargs)`` for a concrete ``torch.optim`` class whose
    signature takes those arguments."""
    cls = getattr(torch.optim, spec["class"], None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise CorruptDataError(f"{url}: network.json field 'optimizer.class' names unknown optimizer {spec['class']!r}")
    if cls.step is torch.optim.Optimizer.step:
        raise CorruptDataError(
            f"{url}: network.json field 'optimizer.class' names {spec['class']!r}, an abstract optimizer "
            "(it implements no step); an archive names a concrete torch.optim class such as 'SGD' or 'Adam'"
        )
    try:
        inspect.signature(cls).bind(None, **spec["kwargs"])  # None stands for the parameters
    except TypeError as e:
        raise CorruptDataError(
            f"{url}: network.json field 'optimizer.kwargs' does not fit torch.optim.{spec['class']}: {e}"
        ) from e
    return functools.partial(cls, **spec["kwargs"])


def load(
    url: str,
    module: torch.nn.Module | None = None,
    storage_options: dict[str, Any] | None = None,
    *,
    loss: str | losses.LossFn | None = None,
    optimizer: Any = None,
) -> Network:
    """Read a network written by :func:`save`.

    The module is ``module`` if given, else rebuilt by the registered factory the archive names.
    ``loss`` and ``optimizer`` override (or supply, when the archive could not record them) the
    archived ones; the optimizer state is restored when the archive has it. A damaged, foreign or
    crafted archive raises :class:`CorruptDataError` naming ``url`` and what is wrong in it.
    """
    return load_with_extra(url, storage_options, module, loss=loss, optimizer=optimizer)[0]


def load_with_extra(
    url: str,
    storage_options: dict[str, Any] | None = None,
    module: torch.nn.Module | None = None,
    *,
    loss: str | losses.LossFn | None = None,
    optimizer: Any = None,
) -> tuple[Network, Any]:
    """:func:`load`, and the ``extra`` data saved with the network (``None`` if none was)."""
    header, blob = _read(url, storage_options)
    tensors = _tensors(header, blob, url)
    module = _module(header, url) if module is None else module
    if loss is None:
        loss = header.get("loss")
        if loss is None:
            raise ValueError(f"{url} was saved with a custom loss function: pass loss=")
        try:
            losses.resolve(loss)
        except UnknownNameError as e:
            e.add_note(f"named in the 'loss' field of {url}")
            raise
    if optimizer is None and header.get("optimizer") is not None:
        optimizer = _optimizer(header["optimizer"], url)
    try:
        network = Network(module, loss, optimizer)
    except ValueError as e:  # e.g. an archived optimizer argument out of range, such as a negative lr
        e.add_note(f"while rebuilding the network archived in {url}")
        raise
    if header.get("factory") is not None:
        network.factory = (header["factory"]["name"], header["factory"]["kwargs"])
    if network.num_params() != header["num_params"]:
        raise ValueError(f"{url} holds {header['num_params']} parameters; the module has {network.num_params()}")
    network.set_params(tensors[0])
    if header.get("optimizer_state") is not None and network.optimizer is not None:
        try:
            network.set_optimizer_state(_decode(header["optimizer_state"], tensors))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise CorruptDataError(
                f"{url}: network.json field 'optimizer_state' does not fit the {type(network.optimizer).__name__} "
                f"optimizer: {type(e).__name__}: {e}"
            ) from e
    network.iteration, network.epoch = header.get("iteration", 0), header.get("epoch", 0)
    network.metadata = header.get("metadata", {})
    return network, header.get("extra")
