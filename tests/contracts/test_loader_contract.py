"""The contract every registered loader meets, checked for each of them: it reads back what its
writer wrote, names the path in its error for a corrupt or foreign file, and pickles (it is shipped
to the workers), still reading after the trip.

A registered loader without a case in ``CASES`` fails here: add how to write data it reads and how
to damage it.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from PIL import Image

from dlscale import registry
from dlscale.data import (
    DataSet,
    Loader,
    MultiDataSet,
    create_file_batches,
    export_zarr,
    resolve_loader,
    save,
)
from dlscale.data.filebatch import FileBatch

Minibatch = DataSet | MultiDataSet
LOADERS = registry.get("loader").view


def datasets(seed: int = 0) -> list[DataSet]:
    """Sequences ``[examples, time, features]`` with class labels per step and masks."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for n in (5, 3, 6):
        mask = (torch.rand(n, 4, generator=g) > 0.3).float()
        batches.append(DataSet(torch.randn(n, 4, 3, generator=g), torch.randint(0, 5, (n, 4), generator=g), mask, mask))
    return batches


def multidatasets(seed: int = 1) -> list[MultiDataSet]:
    g = torch.Generator().manual_seed(seed)
    return [
        MultiDataSet(
            [torch.randn(n, 4, generator=g), torch.randint(0, 9, (n, 2), generator=g)],
            [torch.rand(n, 1, generator=g) > 0.5],
        )
        for n in (4, 7)
    ]


def flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= 0x40
    path.write_bytes(bytes(data))


# -- .dlb files -----------------------------------------------------------------------------------
def dlb_files(batches: list[Minibatch]) -> Callable[[Path], tuple[dict, list[tuple[str, Minibatch]]]]:
    def write(root: Path) -> tuple[dict, list[tuple[str, Minibatch]]]:
        written = []
        for i, batch in enumerate(batches):
            path = str(root / f"batch-{i}.dlb")
            save(batch, path)
            written.append((path, batch))
        return {}, written

    return write


def damaged_dlb_files(other_kind: Minibatch | None) -> Callable[[Path], list[tuple[str, str]]]:
    def damage(root: Path) -> list[tuple[str, str]]:
        good = root / "good.dlb"
        save(DataSet(torch.randn(16, 8), torch.arange(16)), str(good))
        flipped, cut, foreign = root / "flipped.dlb", root / "cut.dlb", root / "foreign.dlb"
        flipped.write_bytes(good.read_bytes())
        flip_byte(flipped, -100)
        cut.write_bytes(good.read_bytes()[:50])
        foreign.write_bytes(b"PK\x03\x04 not a minibatch file\n")
        paths = [str(flipped), str(cut), str(foreign)]
        if other_kind is not None:  # a file of the kind this loader does not read
            save(other_kind, str(root / "other-kind.dlb"))
            paths.append(str(root / "other-kind.dlb"))
        return [(p, p) for p in paths]

    return damage


# -- file batches of images -----------------------------------------------------------------------
def image_batches(root: Path) -> tuple[dict, list[tuple[str, Minibatch]]]:
    rng = np.random.default_rng(0)
    pixels = {}
    for label in ("cats", "dogs"):
        for i in range(5):
            path = root / "src" / label / f"{label}{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            pixels[path.name] = (label, rng.integers(0, 256, (6, 7, 3), dtype=np.uint8))
            Image.fromarray(pixels[path.name][1], "RGB").save(path)
    labels = ["cats", "dogs"]
    written = []
    for url in create_file_batches(str(root / "src"), str(root / "batches"), 4, ["png"]):
        names = [p.rsplit("/", 1)[-1] for p in FileBatch.read(url).paths]
        features = torch.from_numpy(np.stack([pixels[n][1] for n in names])).permute(0, 3, 1, 2).float()
        written.append((url, DataSet(features, torch.tensor([labels.index(pixels[n][0]) for n in names]))))
    return {"labels": labels}, written


def damaged_image_batches(root: Path) -> list[tuple[str, str]]:
    (root / "src" / "cats").mkdir(parents=True)
    (root / "src" / "cats" / "cat0.png").write_bytes(b"\x89PNG\r\n\x1a\n but no image follows")
    (undecodable,) = create_file_batches(str(root / "src"), str(root / "batches"), 4, ["png"])
    flipped, foreign = root / "flipped.zip", root / "foreign.zip"
    image = root / "one" / "cats" / "cat1.png"
    image.parent.mkdir(parents=True)
    Image.fromarray(np.zeros((6, 7, 3), np.uint8), "RGB").save(image)
    (good,) = create_file_batches(str(root / "one"), str(root / "good"), 4, ["png"])
    flipped.write_bytes(Path(good.removeprefix("file://")).read_bytes())
    flip_byte(flipped, 60)
    foreign.write_text("a text file, not a zip archive\n")
    return [(undecodable, undecodable.removeprefix("file://")), (str(flipped),) * 2, (str(foreign),) * 2]


# -- zarr groups ----------------------------------------------------------------------------------
def zarr_group(root: Path) -> tuple[dict, list[tuple[str, Minibatch]]]:
    data = datasets(2)
    refs = export_zarr(iter(data), str(root / "g.zarr"), 4)
    return {}, list(zip(refs, DataSet.merge(data).batch_by(4)))


def damaged_zarr_groups(root: Path) -> list[tuple[str, str]]:
    data = [DataSet(torch.randn(8, 3), torch.arange(8))]
    export_zarr(iter(data), str(root / "flipped.zarr"), 4)
    flip_byte(root / "flipped.zarr" / "features" / "c" / "1" / "0", 10)
    zarr.open_group(store=str(root / "foreign.zarr"), mode="w").create_array("features", shape=(4, 3), dtype="f4")
    return [
        (f"{root / 'flipped.zarr'}#1",) * 2,
        (f"{root / 'foreign.zarr'}#0", str(root / "foreign.zarr")),  # the group is what is foreign
        (str(root / "flipped.zarr"),) * 2,  # a group's URL without the minibatch's index
    ]


@dataclass(frozen=True)
class Case:
    """How to exercise one loader: ``write(dir)`` stores minibatches the loader reads and returns the
    loader's keyword arguments and each path with the minibatch it holds; ``damage(dir)`` stores
    corrupt or foreign files and returns each path with what the error must name (the path, or the
    file or group at fault within it)."""

    write: Callable[[Path], tuple[dict, list[tuple[str, Minibatch]]]]
    damage: Callable[[Path], list[tuple[str, str]]]


CASES: dict[str, Case] = {
    "dlb": Case(dlb_files([*datasets(), *multidatasets()]), damaged_dlb_files(None)),
    "dlb-dataset": Case(dlb_files(datasets()), damaged_dlb_files(multidatasets()[0])),
    "dlb-multi": Case(dlb_files(multidatasets()), damaged_dlb_files(datasets()[0])),
    "image": Case(image_batches, damaged_image_batches),
    "zarr": Case(zarr_group, damaged_zarr_groups),
}


@pytest.fixture(params=sorted(LOADERS))
def case(request: pytest.FixtureRequest) -> tuple[str, Case]:
    """Every registered loader, by name."""
    if request.param not in CASES:
        pytest.fail(f"loader {request.param!r} is registered but has no case in CASES")
    return request.param, CASES[request.param]


def test_reads_what_its_writer_wrote(case: tuple[str, Case], tmp_path: Path) -> None:
    name, c = case
    kwargs, written = c.write(tmp_path)
    loader = resolve_loader(name, **kwargs)
    assert isinstance(loader, LOADERS[name]) and isinstance(loader, Loader)
    assert written
    for path, expected in written:
        got = loader(path)
        assert type(got) is type(expected) and got.equals(expected), path


def test_names_the_path_of_a_corrupt_or_foreign_file(case: tuple[str, Case], tmp_path: Path) -> None:
    name, c = case
    kwargs, _ = c.write(tmp_path / "good")
    loader = resolve_loader(name, **kwargs)
    for path, named in c.damage(tmp_path / "bad"):
        with pytest.raises(Exception) as info:  # noqa: B017 - the kind varies; the message must name the path
            loader(path)
        assert named in str(info.value), path


def test_pickles_and_reads_after_the_trip(case: tuple[str, Case], tmp_path: Path) -> None:
    name, c = case
    kwargs, written = c.write(tmp_path)
    loader = resolve_loader(name, **kwargs)
    path, expected = written[-1]
    assert loader(path).equals(expected)  # whatever it caches must not stop it pickling
    back = pickle.loads(pickle.dumps(loader))
    assert type(back) is type(loader) and repr(back) == repr(loader)
    for path, expected in written:
        assert back(path).equals(expected), path
