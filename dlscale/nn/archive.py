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
itself could name into existence, so a crafted archive cannot run code.
"""

from __future__ import annotations

import functools
import io
import json
import zipfile
from collections.abc import Callable
from typing import Any

import crc32c
import torch

from dlscale import __version__, storage
from dlscale.data.format import DTYPES, raw_bytes, tensor_at
from dlscale.errors import CorruptDataError, StorageError
from dlscale.nn import losses
from dlscale.nn.network import Network
from dlscale.registry import Registry, UnknownNameError

FORMAT = "dlscale-network"
VERSION = 1
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
    if "tensor" in value:
        return tensors[value["tensor"]]
    if "dict" in value:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value["dict"]}
    if "list" in value:
        return [_decode(v, tensors) for v in value["list"]]
    return value["value"]


def save(network: Network, url: str, save_updater: bool = True, storage_options: dict[str, Any] | None = None) -> None:
    """Write ``network`` to ``url`` atomically, with its optimizer state when ``save_updater``."""
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
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("network.json", json.dumps(header))
        z.writestr("tensors.bin", blob)
    storage.write_bytes(url, out.getbuffer(), storage_options=storage_options)


def _read(url: str, storage_options: dict[str, Any] | None) -> tuple[dict, bytes]:
    fs, path = storage.open_fs(url, storage_options)
    try:
        with fs.open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError as e:
        raise StorageError(f"network archive not found: {url}") from e
    except Exception as e:
        raise StorageError(f"cannot read network archive {url}: {e}") from e
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            header = json.loads(z.read("network.json"))
            blob = z.read("tensors.bin")
    except (zipfile.BadZipFile, KeyError, ValueError) as e:
        raise CorruptDataError(f"{url}: not a dlscale network archive ({e})") from e
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CorruptDataError(f"{url}: not a dlscale network archive")
    if header.get("version", 0) > VERSION:
        raise CorruptDataError(
            f"{url}: written in archive version {header['version']}; this dlscale reads up to version {VERSION}"
        )
    if crc32c.crc32c(blob) != header.get("crc32c"):
        raise CorruptDataError(f"{url}: tensor data checksum mismatch (the archive is corrupt)")
    return header, blob


def _tensors(header: dict, blob: bytes, url: str) -> list[torch.Tensor]:
    buf = bytearray(blob)  # writable: the parameters are copied out, optimizer state tensors used as they are
    try:
        return [tensor_at(buf, e) for e in header["tensors"]]
    except ValueError as e:
        raise CorruptDataError(f"{url}: inconsistent tensor entry: {e}") from e


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
    archived ones; the optimizer state is restored when the archive has it.
    """
    header, blob = _read(url, storage_options)
    if module is None:
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
        module = factory(**spec["kwargs"])
    loss = loss if loss is not None else header.get("loss")
    if loss is None:
        raise ValueError(f"{url} was saved with a custom loss function: pass loss=")
    if optimizer is None and header.get("optimizer") is not None:
        spec = header["optimizer"]
        cls = getattr(torch.optim, spec["class"], None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise CorruptDataError(f"{url}: unknown optimizer {spec['class']!r}")
        optimizer = functools.partial(cls, **spec["kwargs"])
    network = Network(module, loss, optimizer)
    if header.get("factory") is not None:
        network.factory = (header["factory"]["name"], header["factory"]["kwargs"])
    tensors = _tensors(header, blob, url)
    if network.num_params() != header["num_params"]:
        raise ValueError(f"{url} holds {header['num_params']} parameters; the module has {network.num_params()}")
    network.set_params(tensors[0])
    if header.get("optimizer_state") is not None and network.optimizer is not None:
        network.set_optimizer_state(_decode(header["optimizer_state"], tensors))
    network.iteration, network.epoch = header.get("iteration", 0), header.get("epoch", 0)
    network.metadata = header.get("metadata", {})
    return network
