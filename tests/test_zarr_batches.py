"""Minibatches in a zarr group: export from RDDs and iterables, load, damage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dlscale import CorruptDataError, OutputExistsError, SparkContext
from dlscale.data import (
    DataSet,
    MultiDataSet,
    ZarrLoader,
    export_zarr,
    list_zarr_batches,
    prefetch,
)


def elements(sizes: list[int], seed: int = 0) -> list[DataSet]:
    g = torch.Generator().manual_seed(seed)
    return [DataSet(torch.randn(n, 3, 4, generator=g), torch.randint(0, 10, (n,), generator=g)) for n in sizes]


def test_export_from_three_partitions_and_train_from_references(sc: SparkContext, tmp_path: Path) -> None:
    data = elements([5, 11, 2, 9, 1, 6])
    url = str(tmp_path / "train.zarr")
    refs = export_zarr(sc.parallelize(data, 3), url, 4)
    expected = DataSet.merge(data).batch_by(4)
    assert refs == [f"{url}#{k}" for k in range(len(expected))]
    loader = ZarrLoader()
    assert all(loader(r).equals(e) for r, e in zip(refs, expected))
    listed = list_zarr_batches(sc, url)
    assert listed.collect() == refs
    # loaded on the workers, with prefetching, as training will
    counts = listed.mapPartitions(lambda it: (ds.num_examples() for ds in prefetch(it, ZarrLoader()))).collect()
    assert counts == [e.num_examples() for e in expected]
    chunks = sorted(p.name for p in (tmp_path / "train.zarr" / "features" / "c").iterdir())
    assert len(chunks) == len(expected)  # one chunk per minibatch


def test_multidataset_iterable_and_s3(s3: dict) -> None:
    g = torch.Generator().manual_seed(1)
    data = [
        MultiDataSet(
            [torch.randn(n, 2, generator=g), torch.randint(0, 5, (n, 3), generator=g)],
            [torch.rand(n, 1, generator=g) > 0.5],
        )
        for n in (3, 7, 4)
    ]
    refs = export_zarr(iter(data), "s3://test-bucket/mds.zarr", 5, storage_options=s3)
    expected = MultiDataSet.merge(data).batch_by(5)
    loader = ZarrLoader(s3)
    assert len(refs) == len(expected) and all(loader(r).equals(e) for r, e in zip(refs, expected))


def test_shapes_must_agree_and_dtypes_must_fit(tmp_path: Path) -> None:
    mixed = [DataSet(torch.randn(2, 3)), DataSet(torch.randn(2, 4))]
    with pytest.raises(ValueError, match="same arrays, dtypes and shapes.*use .dlb files"):
        export_zarr(mixed, str(tmp_path / "mixed.zarr"), 2)
    with pytest.raises(TypeError, match="bfloat16.*use .dlb files"):
        export_zarr([DataSet(torch.randn(2, 3).bfloat16())], str(tmp_path / "bf.zarr"), 2)
    export_zarr(elements([2]), str(tmp_path / "taken.zarr"), 2)
    with pytest.raises(OutputExistsError, match="taken.zarr"):
        export_zarr(elements([2]), str(tmp_path / "taken.zarr"), 2)


def test_damaged_and_unfinished_groups_are_named(tmp_path: Path) -> None:
    url = str(tmp_path / "g.zarr")
    refs = export_zarr(elements([8]), url, 4)
    chunk = tmp_path / "g.zarr" / "features" / "c" / "1" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    assert ZarrLoader()(refs[0]).num_examples() == 4
    with pytest.raises(CorruptDataError, match=r"g\.zarr#1"):
        ZarrLoader()(refs[1])
    meta = tmp_path / "g.zarr" / "zarr.json"
    doc = json.loads(meta.read_text())
    del doc["attributes"]["dlscale"]
    meta.write_text(json.dumps(doc))
    with pytest.raises(CorruptDataError, match="not a complete dlscale minibatch group"):
        ZarrLoader()(refs[0])
    with pytest.raises(ValueError, match="reference"):
        ZarrLoader()(url)
