"""DataSet / MultiDataSet and the minibatch file format: round trips, damage, and safety."""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dask.sizeof import sizeof

from dlscale import CorruptDataError, StorageError
from dlscale.data import DataSet, DataShapeError, MultiDataSet, load, save
from dlscale.data.format import DTYPES, MAGIC


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=g, dtype=torch.int64).to(
        dtype
    )


SHAPES = [(5,), (5, 3), (5, 4, 2), (5, 2, 3, 4), (0, 3)]


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dataset_round_trip_every_dtype_and_shape(dtype: torch.dtype, shape: tuple, tmp_path: Path) -> None:
    ds = DataSet(random_tensor(shape, dtype, 1), random_tensor((shape[0], 2), dtype, 2))
    save(ds, str(tmp_path / "b.dlb"))
    back = load(str(tmp_path / "b.dlb"))
    assert isinstance(back, DataSet) and back.equals(ds)


@pytest.mark.parametrize("masks", ["none", "features", "labels", "both"])
def test_dataset_masks_round_trip(masks: str, tmp_path: Path) -> None:
    fmask = (torch.rand(6, 7) > 0.3).float() if masks in ("features", "both") else None
    lmask = (torch.rand(6, 7) > 0.3).float() if masks in ("labels", "both") else None
    ds = DataSet(torch.randn(6, 7, 3), torch.randn(6, 7, 2), fmask, lmask)
    save(ds, f"file://{tmp_path}/m.dlb")
    assert load(f"file://{tmp_path}/m.dlb").equals(ds)


def test_features_only_and_multi_dataset_round_trip(tmp_path: Path) -> None:
    ds = DataSet(torch.arange(12, dtype=torch.int16).reshape(4, 3))
    save(ds, str(tmp_path / "f.dlb"))
    assert load(str(tmp_path / "f.dlb")).equals(ds)
    mds = MultiDataSet(
        [torch.randn(4, 5, 2), torch.randint(0, 9, (4,)), torch.randn(4, 3).bfloat16()],
        [torch.randn(4, 5, 1), torch.zeros(4, dtype=torch.bool)],
        [torch.ones(4, 5), None, None],
        [torch.ones(4, 5), None],
    )
    save(mds, str(tmp_path / "m.dlb"))
    back = load(str(tmp_path / "m.dlb"))
    assert isinstance(back, MultiDataSet) and back.equals(mds)
    assert back.features_masks[1] is None and back.labels_masks[1] is None


def test_loaded_tensors_are_views_of_one_buffer(tmp_path: Path) -> None:
    ds = DataSet(torch.randn(64, 32), torch.randn(64, 10))
    save(ds, str(tmp_path / "v.dlb"))
    back = load(str(tmp_path / "v.dlb"))
    # labels follow features in the same buffer: no copy was made
    assert back.labels.data_ptr() - back.features.data_ptr() == 64 * 32 * 4
    back.features.add_(1)  # writable
    assert back.features.data_ptr() % 64 == 0 and back.labels.data_ptr() % 64 == 0


def test_non_contiguous_and_requires_grad_inputs(tmp_path: Path) -> None:
    x = torch.randn(5, 8, requires_grad=True)
    ds = DataSet(x.t().contiguous().t()[:, ::2], torch.arange(5))
    save(ds, str(tmp_path / "n.dlb"))
    assert torch.equal(load(str(tmp_path / "n.dlb")).features, ds.features.detach())


def test_s3_round_trip_every_dtype_shape_and_mask(s3: dict) -> None:
    """The same combinations as on local files, against the S3 server."""
    cases = {}
    for name, dtype in DTYPES.items():
        for shape in SHAPES:
            cases[f"{name}-{len(shape)}d-{shape[0]}"] = DataSet(
                random_tensor(shape, dtype, 1), random_tensor((shape[0], 2), dtype, 2)
            )
    for masks in ("features", "labels", "both"):
        fmask = (torch.rand(6, 7) > 0.3).float() if masks in ("features", "both") else None
        lmask = (torch.rand(6, 7) > 0.3).float() if masks in ("labels", "both") else None
        cases[f"mask-{masks}"] = DataSet(torch.randn(6, 7, 3), torch.randn(6, 7, 2), fmask, lmask)
    cases["multi"] = MultiDataSet(
        [torch.randn(3, 4, 2), torch.randint(0, 9, (3,))],
        [torch.randn(3, 4, 1)],
        [torch.ones(3, 4), None],
        [torch.ones(3, 4)],
    )
    for key, ds in cases.items():
        save(ds, f"s3://test-bucket/batches/{key}.dlb", storage_options=s3)
    for key, ds in cases.items():
        back = load(f"s3://test-bucket/batches/{key}.dlb", storage_options=s3)
        assert type(back) is type(ds) and back.equals(ds), key


@pytest.fixture
def good_file(tmp_path: Path) -> Path:
    path = tmp_path / "good.dlb"
    save(DataSet(torch.randn(32, 16), torch.arange(32)), str(path))
    return path


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_truncated_file_is_named(good_file: Path, tmp_path: Path) -> None:
    data = good_file.read_bytes()
    for cut in (10, 40, len(data) // 2, len(data) - 1):
        bad = _write(tmp_path / f"cut{cut}.dlb", data[:cut])
        with pytest.raises(CorruptDataError, match=f"cut{cut}.dlb.*truncated"):
            load(bad)


def test_a_short_foreign_file_is_not_a_minibatch_file(good_file: Path, tmp_path: Path) -> None:
    readme = _write(tmp_path / "README.txt", b"hello")  # shorter than the preamble, and not a minibatch
    with pytest.raises(CorruptDataError, match="README.txt: not a dlscale minibatch file .*b'hello'"):
        load(readme)
    for cut in (0, 3):  # the start of a minibatch file, cut short
        bad = _write(tmp_path / f"cut{cut}.dlb", good_file.read_bytes()[:cut])
        with pytest.raises(CorruptDataError, match=f"cut{cut}.dlb: truncated: {cut} bytes"):
            load(bad)


@pytest.mark.parametrize("where", ["header", "data", "checksum"])
def test_flipped_byte_is_detected(where: str, good_file: Path, tmp_path: Path) -> None:
    data = bytearray(good_file.read_bytes())
    pos = {"header": 40, "data": len(data) - 100, "checksum": len(data) - 2}[where]
    data[pos] ^= 0x01
    bad = _write(tmp_path / "flipped.dlb", bytes(data))
    with pytest.raises(CorruptDataError, match="flipped.dlb.*checksum mismatch"):
        load(bad)


def test_wrong_magic_and_newer_version(good_file: Path, tmp_path: Path) -> None:
    data = good_file.read_bytes()
    with pytest.raises(CorruptDataError, match="foreign.dlb.*not a dlscale minibatch file"):
        load(_write(tmp_path / "foreign.dlb", b"PK\x03\x04" + data[4:]))
    newer = data[:8] + struct.pack("<H", 7) + data[10:]
    with pytest.raises(CorruptDataError, match="newer.dlb.*version 7.*up to version 1"):
        load(_write(tmp_path / "newer.dlb", newer))


def test_missing_path_and_unreachable_endpoint() -> None:
    with pytest.raises(StorageError, match="no/such/file.dlb"):
        load("/no/such/file.dlb")
    unreachable = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    with pytest.raises(StorageError, match="s3://bucket/x.dlb.*127.0.0.1:9"):
        load("s3://bucket/x.dlb", storage_options={**unreachable, "config_kwargs": {"retries": {"max_attempts": 1}}})


class RunsCode:
    def __reduce__(self) -> tuple:
        return (os.system, ("touch PWNED_BY_MINIBATCH",))


def test_pickle_disguised_as_minibatch_does_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    payload = pickle.dumps(RunsCode())
    for name, data in {"plain.dlb": payload, "magic.dlb": MAGIC + payload}.items():
        with pytest.raises(CorruptDataError, match=name):
            load(_write(tmp_path / name, data))
    assert not (tmp_path / "PWNED_BY_MINIBATCH").exists()


def test_a_failed_write_leaves_the_old_file_whole(tmp_path: Path) -> None:
    import fsspec

    from dlscale.storage import atomic_write

    target = tmp_path / "atomic.dlb"
    save(DataSet(torch.ones(2, 2)), str(target))
    before = target.read_bytes()

    unwritable = memoryview(before)
    unwritable.release()  # writing it fails after the first half is in the temporary file
    with pytest.raises(StorageError, match=f"cannot write {target}: .*released"):
        atomic_write(fsspec.filesystem("file"), str(target), [before[: len(before) // 2], unwritable])
    assert target.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["atomic.dlb"]
    with pytest.raises(TypeError, match="dtype"):
        save(DataSet(torch.ones(2, 2, dtype=torch.uint16)), str(target))
    assert load(str(target)).equals(DataSet(torch.ones(2, 2)))


# -- DataSet behaviour ----------------------------------------------------------------------
def test_split_batch_by_shuffle() -> None:
    ds = DataSet(torch.arange(10).float().unsqueeze(1), torch.arange(10))
    a, b = ds.split(0.3)
    assert a.num_examples() == 3 and b.labels.tolist() == list(range(3, 10))
    batches = ds.batch_by(4)
    assert [x.num_examples() for x in batches] == [4, 4, 2]
    assert DataSet.merge(batches).equals(ds)
    s1, s2 = ds.shuffle(seed=3), ds.shuffle(seed=3)
    assert s1.equals(s2) and sorted(s1.labels.tolist()) == list(range(10))
    assert torch.equal(s1.features.squeeze(1).long(), s1.labels)  # rows stay together
    with pytest.raises(ValueError, match="batch size"):
        ds.batch_by(0)


def test_merge_pads_sequences_and_builds_masks() -> None:
    a = DataSet(torch.ones(2, 3, 4), torch.ones(2, 3, 1))
    b = DataSet(torch.full((1, 5, 4), 2.0), torch.full((1, 5, 1), 2.0), torch.tensor([[1, 1, 1, 1, 0.0]]))
    m = DataSet.merge([a, b])
    assert m.features.shape == (3, 5, 4) and m.labels.shape == (3, 5, 1)
    assert m.features_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]
    assert m.labels_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert m.features[0, 3:].abs().sum() == 0 and m.features[2, :].eq(2).all()
    mds = MultiDataSet.merge(
        [
            MultiDataSet([torch.ones(1, 2, 3), torch.ones(1, 4)], [torch.ones(1)]),
            MultiDataSet([torch.ones(2, 4, 3), torch.ones(2, 4)], [torch.zeros(2)]),
        ]
    )
    assert mds.features[0].shape == (3, 4, 3) and mds.features_masks[0].sum() == 2 + 8
    assert mds.features_masks[1] is None and mds.labels[0].tolist() == [1, 0, 0]


def test_shape_errors_name_the_array() -> None:
    with pytest.raises(DataShapeError, match="number of examples"):
        DataSet(torch.ones(3, 2), torch.ones(4))
    with pytest.raises(DataShapeError, match="features_mask"):
        DataSet(torch.ones(3, 5, 2), None, torch.ones(3, 4))
    with pytest.raises(TypeError, match="labels must be a torch.Tensor"):
        DataSet(torch.ones(2), [1, 2])  # type: ignore[arg-type]
    with pytest.raises(DataShapeError, match="features_masks has 1 entries for 2"):
        MultiDataSet([torch.ones(2), torch.ones(2)], [], [None])
    with pytest.raises(DataShapeError, match="cannot merge features"):
        DataSet.merge([DataSet(torch.ones(2, 3)), DataSet(torch.ones(2, 4))])


def test_sizeof_counts_tensor_bytes() -> None:
    ds = DataSet(torch.zeros(1000, 100), torch.zeros(1000, dtype=torch.int64))
    assert sizeof(ds) >= ds.nbytes() == 1000 * 100 * 4 + 1000 * 8
    mds = MultiDataSet([torch.zeros(100, 100)], [torch.zeros(100, 10)])
    assert sizeof(mds) >= 100 * 110 * 4


def test_sizing_other_dlscale_objects_imports_no_torch() -> None:
    """A worker sizes every task's result: a partition's statistics (what ``meanApprox`` returns) must not
    import torch, whose import takes seconds the task would wait for."""
    program = (
        "import sys; from dask.sizeof import sizeof; from dlscale.facade.statcounter import StatCounter; "
        "assert 'torch' not in sys.modules; assert sizeof([StatCounter([1.0, 2.0])]) > 0; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"


def test_per_example_and_per_output_labels_masks_round_trip(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    flags = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    batches = [
        DataSet(torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g), None, flags),  # [examples]
        DataSet(
            torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g), None, torch.rand(6, 3, generator=g) > 0.5
        ),
        DataSet(torch.randn(6, 5, 2, generator=g), torch.randn(6, 5, 3, generator=g), None, flags),  # sequences
        MultiDataSet(
            [torch.randn(6, 4, generator=g)],
            [torch.randn(6, 2, generator=g), torch.randn(6, 1, generator=g)],
            None,
            [flags.bool(), None],
        ),
    ]
    for i, batch in enumerate(batches):
        save(batch, str(tmp_path / f"{i}.dlb"))
        assert load(str(tmp_path / f"{i}.dlb")).equals(batch)


def test_merging_per_example_masks() -> None:
    x = torch.arange(5.0)[:, None]
    a = DataSet(x[:2], torch.tensor([0, 1]), None, torch.tensor([1.0, 0.0]))
    b = DataSet(x[2:], torch.tensor([2, 0, 1]))  # no mask: every example counts
    merged = DataSet.merge([a, b])
    assert merged.labels_mask.tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]
    seq_a = DataSet(torch.ones(2, 3, 1), torch.ones(2, 3, 1), None, torch.tensor([0.0, 1.0]))
    seq_b = DataSet(torch.ones(1, 2, 1), torch.ones(1, 2, 1), None, torch.tensor([[1.0, 0.0]]))
    # padded to 3 steps: an example's flag holds for each of its steps, the padding is masked
    assert DataSet.merge([seq_a, seq_b]).labels_mask.tolist() == [[0, 0, 0], [1, 1, 1], [1, 0, 0]]


def test_a_mask_of_the_wrong_shape_says_which_shapes_fit() -> None:
    x = torch.randn(8, 5)
    fits = r"\[examples\] = \(8,\) or \[examples, time\] / \[examples, outputs\] = \(8, 3\)"
    with pytest.raises(DataShapeError, match=rf"labels_mask has shape \(8, 4\); a labels mask is {fits}"):
        DataSet(x, torch.randn(8, 3), None, torch.ones(8, 4))
    with pytest.raises(
        DataShapeError, match=r"labels_mask has shape \(8, 3\); a labels mask is \[examples\] = \(8,\)$"
    ):
        DataSet(x, torch.zeros(8, dtype=torch.long), None, torch.ones(8, 3))
    with pytest.raises(
        DataShapeError, match=r"features_mask has shape \(8,\); a features mask is \[examples, time\] = \(8, 5\)"
    ):
        DataSet(x, None, torch.ones(8))
