"""File batches: packing real image and text files, loading them as DataSets, and damaged input."""

from __future__ import annotations

import io
import json
import tracemalloc
import zipfile
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
from PIL import Image

from dlscale import CorruptDataError, OutputExistsError, SparkContext, StorageError
from dlscale.data import DataSet, DataShapeError, filebatch
from dlscale.data.filebatch import FileBatch, create_file_batches
from dlscale.data.images import (
    ImageFileBatchLoader,
    ImagePreProcessingScaler,
    parent_path_labels,
)
from dlscale.errors import LabelError

W, H = 10, 8
IMAGES = ["png", "jpg"]


def write_image(path: Path, mode: str, seed: int, size: tuple[int, int] = (W, H)) -> None:
    rng = np.random.default_rng(seed)
    shape = (size[1], size[0]) if mode == "L" else (size[1], size[0], len(mode))
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(path)


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """cats: RGB PNGs, dogs: greyscale PNGs, birds: JPEGs, notes: text, plus files to skip."""
    root = tmp_path_factory.mktemp("src")
    for i in range(7):
        write_image(root / "cats" / f"cat{i}.png", "RGB", i)
    for i in range(6):
        write_image(root / "dogs" / f"dog{i}.PNG", "L", 100 + i)
    for i in range(5):
        write_image(root / "birds" / f"bird{i}.jpg", "RGB", 200 + i)
    for i in range(3):
        (root / "notes").mkdir(exist_ok=True)
        (root / "notes" / f"note{i}.txt").write_text(f"note {i}\n" * (i + 1))
    write_image(root / "cats" / ".hidden.png", "RGB", 900)
    write_image(root / "_temporary" / "cats" / "partial.png", "RGB", 901)
    write_image(root / ".cache" / "x.png", "RGB", 902)
    return root


def url(path: Path) -> str:
    return f"file://{path}"


def local(file_url: str) -> Path:
    assert file_url.startswith("file://")
    return Path(file_url[len("file://") :])


def source_images(src: Path) -> list[Path]:
    return sorted(p for p in src.glob("[!._]*/[!._]*") if p.suffix.lower() in (".png", ".jpg"))


def reference(path: Path, mode: str, size: tuple[int, int] | None = None) -> torch.Tensor:
    """The image decoded straight from the original file, as float32 [C, H, W]."""
    with Image.open(path) as img:
        img = img.convert(mode)
        if size is not None:
            img = img.resize(size, Image.Resampling.BILINEAR)
        a = np.asarray(img, dtype=np.float32)
    return torch.from_numpy((a[:, :, None] if a.ndim == 2 else a).transpose(2, 0, 1).copy())


def read_all(urls: list[str], storage_options: dict | None = None) -> list[FileBatch]:
    return [FileBatch.read(u, storage_options) for u in urls]


# -- creating batches ------------------------------------------------------------------------
def test_every_file_once_with_its_bytes(src: Path, tmp_path: Path) -> None:
    urls = create_file_batches(str(src), str(tmp_path / "out"), 5, ["png", ".JPG"])
    assert urls == [url(tmp_path / "out" / f"filebatch_{i:08d}.zip") for i in range(4)]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"filebatch_{i:08d}.zip" for i in range(4)]
    batches = read_all(urls)
    assert [len(b.paths) for b in batches] == [5, 5, 5, 3]
    paths = [p for b in batches for p in b.paths]
    expected = source_images(src)
    assert len(expected) == 18 and sorted(paths) == [url(p) for p in expected]
    for b in batches:
        for p, data in zip(b.paths, b.contents):
            assert data == local(p).read_bytes()
    assert paths != sorted(paths)  # shuffled across classes


def test_seed_none_keeps_sorted_order_and_no_filter_takes_all(src: Path, tmp_path: Path) -> None:
    urls = create_file_batches(url(src), url(tmp_path / "out"), 4, seed=None)
    paths = [p for b in read_all(urls) for p in b.paths]
    everything = sorted(p for p in src.glob("[!._]*/[!._]*") if p.is_file())
    assert paths == [url(p) for p in everything] and len(paths) == 21
    assert [len(b.paths) for b in read_all(urls)] == [4] * 5 + [1]


def test_non_recursive_and_single_file(src: Path, tmp_path: Path) -> None:
    urls = create_file_batches(str(src / "notes"), str(tmp_path / "a"), 2, ["txt"], recursive=False)
    assert sorted(p for b in read_all(urls) for p in b.paths) == [url(src / "notes" / f"note{i}.txt") for i in range(3)]
    with pytest.raises(StorageError, match="no files with extensions"):
        create_file_batches(str(src), str(tmp_path / "b"), 2, ["png"], recursive=False)
    one = create_file_batches(str(src / "cats" / "cat0.png"), str(tmp_path / "c"), 2)
    assert FileBatch.read(one[0]).paths == [url(src / "cats" / "cat0.png")]


def test_same_seed_same_bytes_and_cluster_matches_local(src: Path, tmp_path: Path, sc: SparkContext) -> None:
    local_urls = create_file_batches(str(src), str(tmp_path / "local"), 4, IMAGES, seed=7)
    spark_urls = create_file_batches(str(src), str(tmp_path / "spark"), 4, IMAGES, seed=7, sc=sc)
    assert [u.rsplit("/", 1)[1] for u in local_urls] == [u.rsplit("/", 1)[1] for u in spark_urls]
    for a, b in zip(local_urls, spark_urls):
        assert local(a).read_bytes() == local(b).read_bytes()
    other = create_file_batches(str(src), str(tmp_path / "other"), 4, IMAGES, seed=8)
    assert [b.paths for b in read_all(other)] != [b.paths for b in read_all(local_urls)]


def test_zip_layout(src: Path, tmp_path: Path) -> None:
    urls = create_file_batches(str(src), str(tmp_path / "out"), 50, seed=None)
    with zipfile.ZipFile(local(urls[0])) as zf:
        infos = zf.infolist()
        manifest = json.loads(zf.read("manifest.json"))
        assert infos[0].filename == "manifest.json"
        assert manifest == {"format": "dlscale-filebatch", "version": 1, "paths": manifest["paths"]}
        assert len(manifest["paths"]) == len(infos) - 1 == 21
        for i, (path, info) in enumerate(zip(manifest["paths"], infos[1:])):
            suffix = Path(path).suffix
            assert info.filename == f"files/{i:08d}{suffix}"
            stored = suffix.lower() in (".png", ".jpg")
            assert info.compress_type == (zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED)
            assert zf.read(info) == local(path).read_bytes()
    assert not list((tmp_path / "out").glob(".*"))  # no temporary files left


def test_output_and_input_errors(src: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        create_file_batches(str(src), str(tmp_path / "o"), 0)
    with pytest.raises(StorageError, match="nowhere"):
        create_file_batches(str(tmp_path / "nowhere"), str(tmp_path / "o"), 2)
    with pytest.raises(StorageError, match=r"'\.gif'.*notes"):
        create_file_batches(str(src / "notes"), str(tmp_path / "o"), 2, ["GIF"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "filebatch_00000000.zip").write_bytes(b"old")
    with pytest.raises(OutputExistsError, match="full"):
        create_file_batches(str(src), str(tmp_path / "full"), 2)
    (tmp_path / "empty").mkdir()
    assert len(create_file_batches(str(src / "notes"), str(tmp_path / "empty"), 2)) == 2


# -- reading damaged batches -----------------------------------------------------------------
@pytest.fixture
def batch_file(src: Path, tmp_path: Path) -> Path:
    """A batch with a stored PNG and a deflated text file."""
    paths = [src / "cats" / "cat0.png", src / "notes" / "note2.txt"]
    FileBatch([url(p) for p in paths], [p.read_bytes() for p in paths]).write(str(tmp_path / "b.zip"))
    return tmp_path / "b.zip"


@pytest.mark.parametrize("member", ["files/00000000.png", "files/00000001.txt", "manifest.json"])
def test_flipped_byte_is_corrupt(batch_file: Path, member: str) -> None:
    data = bytearray(batch_file.read_bytes())
    with zipfile.ZipFile(batch_file) as zf:
        info = zf.getinfo(member)
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    data[start + info.compress_size // 2] ^= 0x40
    batch_file.write_bytes(bytes(data))
    with pytest.raises(CorruptDataError, match=f"^{batch_file}"):
        FileBatch.read(str(batch_file))


def test_truncated_and_foreign_files(batch_file: Path, tmp_path: Path) -> None:
    data = batch_file.read_bytes()
    cases = {"truncated": data[: len(data) // 2], "empty": b"", "text": b"hello, not a zip\n"}
    for name, blob in cases.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(CorruptDataError, match=f"^{tmp_path / name}: not a readable file batch"):
            FileBatch.read(str(tmp_path / name))


def zip_of(entries: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in entries:
            zf.writestr(name, data)
    return buf.getvalue()


def manifest(**fields: object) -> tuple[str, bytes]:
    return "manifest.json", json.dumps(
        {"format": "dlscale-filebatch", "version": 1, "paths": ["a/b.txt"], **fields}
    ).encode()


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([("files/00000000.txt", b"x")], "no manifest.json"),
        ([("files/00000000.txt", b"x"), manifest()], "no manifest.json"),
        ([manifest(format="other"), ("files/00000000.txt", b"x")], "not a dlscale-filebatch manifest"),
        ([manifest(version=2), ("files/00000000.txt", b"x")], "version 2; this dlscale reads up to version 1"),
        ([manifest(version="1"), ("files/00000000.txt", b"x")], "unknown file batch format version"),
        ([manifest(paths="a/b.txt"), ("files/00000000.txt", b"x")], "no list of paths"),
        (
            [manifest(paths=["a/b.txt", "a/c.txt"]), ("files/00000000.txt", b"x")],
            "lists 2 files but the archive holds 1",
        ),
        ([manifest(), ("files/00000007.txt", b"x")], "should be 'files/00000000.txt'"),
        ([("manifest.json", b"{not json"), ("files/00000000.txt", b"x")], "not a readable file batch"),
    ],
    ids=["no-manifest", "manifest-not-first", "foreign", "newer", "bad-version", "bad-paths", "count", "name", "json"],
)
def test_bad_archives(entries: list, message: str, tmp_path: Path) -> None:
    (tmp_path / "x.zip").write_bytes(zip_of(entries))
    with pytest.raises(CorruptDataError, match=f"^{tmp_path / 'x.zip'}: .*{message}"):
        FileBatch.read(str(tmp_path / "x.zip"))


def test_size_guard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bomb = FileBatch(["a/zeros.txt"], [bytes(5_000_000)])
    bomb.write(str(tmp_path / "bomb.zip"))
    assert (tmp_path / "bomb.zip").stat().st_size < 50_000
    monkeypatch.setattr(filebatch, "MAX_BATCH_BYTES", 1_000_000)
    with pytest.raises(CorruptDataError, match=f"^{tmp_path / 'bomb.zip'}: declares 5000"):
        FileBatch.read(str(tmp_path / "bomb.zip"))
    with pytest.raises(ValueError, match="smaller batch_size"):
        bomb.write(str(tmp_path / "again.zip"))


def test_entry_larger_than_declared_is_not_inflated(tmp_path: Path) -> None:
    data = bytearray(FileBatch(["a/zeros.txt"], [bytes(50_000_000)]).to_bytes())
    entry = data.rfind(b"PK\x01\x02")  # the central directory record of the last entry
    data[entry + 24 : entry + 28] = (1000).to_bytes(4, "little")  # declare 1000 bytes uncompressed
    (tmp_path / "lying.zip").write_bytes(bytes(data))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptDataError, match=f"^{tmp_path / 'lying.zip'}"):
            FileBatch.read(str(tmp_path / "lying.zip"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000


def test_missing_batch_names_url(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match=f"not found: {tmp_path / 'none.zip'}"):
        FileBatch.read(str(tmp_path / "none.zip"))


# -- loading images --------------------------------------------------------------------------
@pytest.mark.parametrize(("channels", "mode"), [(3, "RGB"), (1, "L"), (4, "RGBA")])
def test_loader_matches_pillow(src: Path, tmp_path: Path, channels: int, mode: str) -> None:
    labels = parent_path_labels(str(src), IMAGES)
    assert labels == ["birds", "cats", "dogs"]
    urls = create_file_batches(str(src), str(tmp_path / "out"), 8, IMAGES)
    loader = ImageFileBatchLoader(labels, channels=channels)
    for u, batch in zip(urls, read_all(urls)):
        ds = loader(u)
        assert ds.features.dtype == torch.float32 and ds.features.shape == (len(batch.paths), channels, H, W)
        assert torch.equal(ds.features, torch.stack([reference(local(p), mode) for p in batch.paths]))
        assert ds.labels.tolist() == [labels.index(local(p).parent.name) for p in batch.paths]
        assert ds.labels.dtype == torch.int64


def test_resize_scale_and_workers(src: Path, tmp_path: Path, sc: SparkContext) -> None:
    labels = ["dogs", "cats", "birds"]
    urls = create_file_batches(str(src), str(tmp_path / "out"), 8, IMAGES, sc=sc)
    loader = ImageFileBatchLoader(labels, 6, 12, 3, preprocessor=ImagePreProcessingScaler())
    on_workers = sc.parallelize(urls, 2).map(loader).collect()
    for u, ds in zip(urls, on_workers):
        batch = FileBatch.read(u)
        expected = torch.stack([reference(local(p), "RGB", (12, 6)) for p in batch.paths]) / 255
        assert ds.features.shape == (len(batch.paths), 3, 6, 12)
        assert torch.equal(ds.features, expected)
        assert ds.labels.tolist() == [labels.index(local(p).parent.name) for p in batch.paths]
        assert ds.equals(loader(u))


def test_scaler_ranges() -> None:
    x = torch.arange(256, dtype=torch.float32).reshape(4, 4, 4, 4)  # every pixel value
    ds = DataSet(x, torch.arange(4), None, None)
    out = ImagePreProcessingScaler()(ds)
    assert torch.equal(out.features, x / 255) and out.labels is ds.labels
    signed = ImagePreProcessingScaler(-1.0, 1.0)(ds)
    reference = torch.from_numpy(x.numpy().astype(np.float64) / 255 * 2 - 1)
    assert torch.allclose(signed.features.double(), reference, rtol=0, atol=1e-6)
    assert signed.features.min() >= -1 and signed.features.max() <= 1
    as_bytes = ImagePreProcessingScaler(max_pixel=255)(DataSet(x.to(torch.uint8)))
    assert as_bytes.features.dtype == torch.float32 and torch.equal(as_bytes.features, x / 255)
    assert torch.equal(x, ds.features)  # the input is not changed
    with pytest.raises(ValueError, match="max_pixel"):
        ImagePreProcessingScaler(max_pixel=0)


def test_loader_errors(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cat, dog = src / "cats" / "cat0.png", src / "dogs" / "dog0.PNG"

    def batch(name: str, files: list[tuple[str, bytes]]) -> str:
        FileBatch([f for f, _ in files], [d for _, d in files]).write(str(tmp_path / name))
        return str(tmp_path / name)

    ok = batch("ok.zip", [(url(cat), cat.read_bytes()), (url(dog), dog.read_bytes())])
    with pytest.raises(LabelError, match=r"dog0\.PNG: folder 'dogs' is not one of the labels \['cats'\]") as e:
        ImageFileBatchLoader(["cats"])(ok)
    assert isinstance(e.value, ValueError)

    big = tmp_path / "big" / "cats" / "big.png"
    write_image(big, "RGB", 5, (W + 1, H))
    mixed = batch("mixed.zip", [(url(cat), cat.read_bytes()), (url(big), big.read_bytes())])
    with pytest.raises(DataShapeError, match=f"big.png in {tmp_path / 'mixed.zip'} is 11x8"):
        ImageFileBatchLoader(["cats"])(mixed)
    assert ImageFileBatchLoader(["cats"], H, W)(mixed).features.shape == (2, 3, H, W)

    png = cat.read_bytes()
    for name, data in [("garbage.png", b"not an image"), ("cut.png", png[: len(png) // 2])]:
        bad = batch(f"{name}.zip", [(url(cat), png), (f"file:///data/cats/{name}", data)])
        with pytest.raises(CorruptDataError, match=f"{name} in {bad}: cannot decode"):
            ImageFileBatchLoader(["cats"])(bad)

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", W * H - 1)  # Pillow only warns; the loader refuses
    with (
        pytest.raises(CorruptDataError, match=f"cat0.png in {ok}: 10x8 pixels is more than"),
        pytest.warns(Image.DecompressionBombWarning),
    ):
        ImageFileBatchLoader(["cats", "dogs"])(ok)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", W * H // 3)
    with pytest.raises(CorruptDataError, match="cat0.png in .*decompression bomb"):
        ImageFileBatchLoader(["cats", "dogs"])(ok)

    for kwargs in [{"channels": 2}, {"height": 4}, {"height": 0, "width": 4}]:
        with pytest.raises(ValueError):
            ImageFileBatchLoader(["cats"], **kwargs)
    with pytest.raises(ValueError, match="distinct"):
        ImageFileBatchLoader(["cats", "cats"])


# -- object storage --------------------------------------------------------------------------
def test_s3_round_trip(src: Path, s3: dict, sc: SparkContext) -> None:
    fs = fsspec.filesystem("s3", **s3)
    files = source_images(src)
    for p in files:
        fs.pipe_file(f"test-bucket/src/{p.parent.name}/{p.name}", p.read_bytes())
    fs.pipe_file("test-bucket/src/cats/_SUCCESS", b"")
    labels = parent_path_labels("s3://test-bucket/src", IMAGES, storage_options=s3)
    assert labels == ["birds", "cats", "dogs"]
    urls = create_file_batches("s3://test-bucket/src", "s3://test-bucket/batches", 6, IMAGES, sc=sc, storage_options=s3)
    assert urls == [f"s3://test-bucket/batches/filebatch_{i:08d}.zip" for i in range(3)]
    by_name = {f"s3://test-bucket/src/{p.parent.name}/{p.name}": p for p in files}
    loader = ImageFileBatchLoader(labels, storage_options=s3)
    seen = []
    for u in urls:
        batch = FileBatch.read(u, storage_options=s3)
        assert [d for d in batch.contents] == [by_name[p].read_bytes() for p in batch.paths]
        ds = loader(u)
        assert torch.equal(ds.features, torch.stack([reference(by_name[p], "RGB") for p in batch.paths]))
        seen += batch.paths
    assert sorted(seen) == sorted(by_name)
    with pytest.raises(OutputExistsError, match="s3://test-bucket/batches"):
        create_file_batches("s3://test-bucket/src", "s3://test-bucket/batches", 6, storage_options=s3)
    with pytest.raises(StorageError, match="s3://test-bucket/batches/none.zip"):
        FileBatch.read("s3://test-bucket/batches/none.zip", storage_options=s3)
