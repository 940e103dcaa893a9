"""Text, binary and pickle files on local disk and on S3 (moto on 127.0.0.1), against PySpark."""

from __future__ import annotations

import gzip
import os
import pickle
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch

from dlscale import (
    CorruptDataError,
    OutputExistsError,
    SparkContext,
    StorageError,
    UnsafePickleError,
)


@pytest.fixture
def text_dir(tmp_path: Path) -> Path:
    d = tmp_path / "text"
    d.mkdir()
    (d / "a.txt").write_text("alpha\nbeta\n\ngamma\n")
    (d / "b.txt").write_text("".join(f"line {i}\r\n" for i in range(200)) + "no newline at end")
    (d / "c.txt.gz").write_bytes(gzip.compress(b"zipped one\nzipped two\n"))
    (d / "_SUCCESS").write_text("")
    (d / ".hidden").write_text("never read\n")
    return d


@pytest.mark.pyspark
@pytest.mark.parametrize("min_partitions", [None, 1, 5])
def test_text_file_matches_pyspark(text_dir: Path, min_partitions: int | None, sc: SparkContext, spark: Any) -> None:
    ours = sc.textFile(str(text_dir), min_partitions)
    theirs = spark.textFile(str(text_dir), min_partitions)
    assert sorted(ours.collect()) == sorted(theirs.collect())
    assert ours.count() == 4 + 201 + 2
    if min_partitions == 5:
        assert ours.getNumPartitions() >= 5


@pytest.mark.pyspark
def test_whole_text_and_binary_files_match_pyspark(text_dir: Path, sc: SparkContext, spark: Any) -> None:
    def by_name(pairs: list) -> list:
        return sorted((os.path.basename(p), v) for p, v in pairs)

    assert (
        by_name(sc.wholeTextFiles(str(text_dir)).collect())[:2]
        == by_name(spark.wholeTextFiles(str(text_dir)).collect())[:2]
    )
    ours = dict(by_name(sc.binaryFiles(str(text_dir)).collect()))
    assert ours["a.txt"] == b"alpha\nbeta\n\ngamma\n"
    assert set(ours) == {"a.txt", "b.txt", "c.txt.gz"}
    assert sc.binaryFiles(str(text_dir)).keys().first().startswith("file://")


def test_text_file_glob_and_comma_separated(text_dir: Path, sc: SparkContext) -> None:
    assert sc.textFile(str(text_dir / "a*")).collect() == ["alpha", "beta", "", "gamma"]
    both = sc.textFile(f"{text_dir / 'a.txt'},{text_dir / 'c.txt.gz'}").collect()
    assert both == ["alpha", "beta", "", "gamma", "zipped one", "zipped two"]
    assert sc.textFile(str(text_dir / "a.txt"), use_unicode=False).first() == b"alpha"


@pytest.mark.pyspark
@pytest.mark.parametrize("codec", [None, "org.apache.hadoop.io.compress.GzipCodec"])
def test_save_as_text_file_is_read_by_pyspark(tmp_path: Path, codec: str | None, sc: SparkContext, spark: Any) -> None:
    data = [1, "two", 3.5, ("t", 4), None]
    sc.parallelize(data, 3).saveAsTextFile(str(tmp_path / "out"), codec)
    names = sorted(os.listdir(tmp_path / "out"))
    ext = ".gz" if codec else ""
    assert names == ["_SUCCESS", f"part-00000{ext}", f"part-00001{ext}", f"part-00002{ext}"]
    spark.parallelize(data, 3).saveAsTextFile(str(tmp_path / "ref"), codec)
    assert spark.textFile(str(tmp_path / "out")).collect() == spark.textFile(str(tmp_path / "ref")).collect()


def test_save_refuses_existing_output(tmp_path: Path, sc: SparkContext) -> None:
    sc.parallelize([1]).saveAsTextFile(str(tmp_path / "out"))
    with pytest.raises(OutputExistsError, match="out already exists"):
        sc.parallelize([2]).saveAsTextFile(str(tmp_path / "out"))
    assert sc.textFile(str(tmp_path / "out")).collect() == ["1"]


def test_missing_path_is_named(tmp_path: Path, sc: SparkContext) -> None:
    missing = str(tmp_path / "nope")
    for read in (sc.textFile, sc.wholeTextFiles, sc.binaryFiles, sc.pickleFile):
        with pytest.raises(StorageError, match="nope") as e:
            read(missing)
        assert isinstance(e.value, OSError)


def test_unknown_protocol_is_named(sc: SparkContext) -> None:
    with pytest.raises(StorageError, match="nosuchfs://x"):
        sc.textFile("nosuchfs://x/y")


def test_pickle_file_round_trip_with_tensors(tmp_path: Path, sc: SparkContext) -> None:
    data = [{"x": torch.arange(6, dtype=torch.float32).reshape(2, 3) * i, "y": i} for i in range(25)]
    sc.parallelize(data, 4).saveAsPickleFile(str(tmp_path / "p"), batchSize=3)
    back = sc.pickleFile(str(tmp_path / "p")).collect()
    assert [d["y"] for d in back] == list(range(25))
    assert all(torch.equal(a["x"], b["x"]) for a, b in zip(data, back))


class Trusted:
    def __init__(self, v: int) -> None:
        self.v = v

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Trusted) and other.v == self.v


class Payload:
    def __reduce__(self) -> tuple:
        return (os.system, ("touch PWNED",))


def test_pickle_file_refuses_classes_not_allowed(tmp_path: Path, sc: SparkContext) -> None:
    sc.parallelize([Trusted(1), Trusted(2)], 1).saveAsPickleFile(str(tmp_path / "t"))
    with pytest.raises(UnsafePickleError, match="tests.test_io.Trusted"):
        sc.pickleFile(str(tmp_path / "t")).collect()
    assert sc.pickleFile(str(tmp_path / "t"), allowed=["tests.test_io:Trusted"]).collect() == [Trusted(1), Trusted(2)]


def test_crafted_pickle_file_does_not_run(tmp_path: Path, sc: SparkContext, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "evil"
    out.mkdir()
    blob = pickle.dumps([Payload()])
    (out / "part-00000").write_bytes(b"DLSPKL1\n" + len(blob).to_bytes(8, "little") + blob)
    marker = tmp_path / "PWNED"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsafePickleError, match="system"):
        sc.pickleFile(str(out)).collect()
    assert not marker.exists()
    assert sc.client.run(lambda: os.path.exists(str(marker))) == dict.fromkeys(sc.client.run(os.getpid), False)


STRUCTURED = [
    np.zeros(2, [("a", "i4"), ("b", "f8")]),
    np.array(
        [((1.5, [2.0, 3.0]), b"abc", "xy"), ((4.0, [5.0, 6.0]), b"d", "z")],
        [("p", [("x", "<f4"), ("y", "<f4", (2,))]), ("q", "S3"), ("r", "<U2")],
    ),
    np.array([(1, 2.5), (3, 4.5)], np.dtype([("a", "u1"), ("b", ">f8")], align=True)),
    np.ones(3, np.dtype({"names": ["a", "b"], "formats": ["<i4", ("<f8", (2, 3))], "offsets": [0, 8], "itemsize": 64})),
]


def same_array(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a.dtype == b.dtype and a.dtype.descr == b.dtype.descr and a.tobytes() == b.tobytes()


def test_pickle_file_keeps_structured_dtypes(tmp_path: Path, sc: SparkContext) -> None:
    data = [*STRUCTURED, STRUCTURED[1][0]]  # the arrays and a structured scalar (np.void)
    data[0]["a"], data[0]["b"] = [7, -1], [0.25, 1e300]
    sc.parallelize(data, 2).saveAsPickleFile(str(tmp_path / "s"))
    back = sc.pickleFile(str(tmp_path / "s")).collect()
    assert len(back) == len(data) and all(same_array(a, b) for a, b in zip(data, back))
    assert back[1]["p"]["y"].tolist() == [[2.0, 3.0], [5.0, 6.0]] and back[1]["r"].tolist() == ["xy", "z"]
    with pytest.raises(pickle.PicklingError, match="Python objects \\(field 'o'\\)"):
        sc.parallelize([np.zeros(1, [("i", "i4"), ("o", "O")])], 1).saveAsPickleFile(str(tmp_path / "o"))


class CraftedArray:
    """Pickles as a call of the safe format's array builder with the given dtype description."""

    def __init__(self, dtype: Any, data: bytes) -> None:
        self.dtype, self.data = dtype, data

    def __reduce__(self) -> tuple:
        from dlscale.facade._safe_pickle import _rebuild_ndarray

        return _rebuild_ndarray, (self.dtype, (1,), self.data)


@pytest.mark.parametrize(
    ("dtype", "error", "message"),
    [
        ({"names": ["o"], "formats": ["O"], "offsets": [0], "itemsize": 8}, UnsafePickleError, "Python objects"),
        ([["O", [1]], [1]], UnsafePickleError, "Python objects"),
        ({"names": "o", "formats": ["<i8"], "offsets": [0], "itemsize": 8}, CorruptDataError, "malformed structured"),
        ({"names": ["o"], "formats": ["<i8"], "offsets": [0], "itemsize": 8, "x": 1}, CorruptDataError, "not a dtype"),
        (3, CorruptDataError, "not a dtype description: 3"),
    ],
)
def test_crafted_dtype_descriptions_are_refused(
    tmp_path: Path, sc: SparkContext, dtype: Any, error: type, message: str
) -> None:
    out = tmp_path / "crafted"
    out.mkdir()
    blob = pickle.dumps([CraftedArray(dtype, bytes(8))])
    (out / "part-00000").write_bytes(b"DLSPKL1\n" + len(blob).to_bytes(8, "little") + blob)
    with pytest.raises(error, match=message):
        sc.pickleFile(str(out)).collect()


@pytest.mark.pyspark
def test_structured_arrays_round_trip_like_pyspark(tmp_path: Path, sc: SparkContext, spark: Any) -> None:
    sc.parallelize(STRUCTURED, 2).saveAsPickleFile(str(tmp_path / "ours"))
    spark.parallelize(STRUCTURED, 2).saveAsPickleFile(str(tmp_path / "theirs"))
    ours = sc.pickleFile(str(tmp_path / "ours")).collect()
    theirs = spark.pickleFile(str(tmp_path / "theirs")).collect()
    assert all(same_array(a, b) for a, b in zip(ours, theirs)) and all(
        same_array(a, b) for a, b in zip(ours, STRUCTURED)
    )


def test_corrupt_pickle_files_name_the_file(tmp_path: Path, sc: SparkContext) -> None:
    sc.parallelize(list(range(50)), 1).saveAsPickleFile(str(tmp_path / "ok"))
    data = (tmp_path / "ok" / "part-00000").read_bytes()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "part-00000").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptDataError, match="part-00000.*truncated"):
        sc.pickleFile(str(bad)).collect()
    (bad / "part-00000").write_bytes(b"NOTMAGIC" + data[8:])
    with pytest.raises(CorruptDataError, match="not a dlscale pickle file"):
        sc.pickleFile(str(bad)).collect()


def test_s3_round_trip(s3: dict, sc: SparkContext) -> None:
    sc.parallelize([f"row {i}" for i in range(100)], 4).saveAsTextFile("s3://test-bucket/lines", storage_options=s3)
    fs = fsspec.filesystem("s3", **s3)
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls("test-bucket/lines")) == [
        "_SUCCESS",
        "part-00000",
        "part-00001",
        "part-00002",
        "part-00003",
    ]
    back = sc.textFile("s3://test-bucket/lines", storage_options=s3)
    assert back.collect() == [f"row {i}" for i in range(100)]
    sc.parallelize([torch.ones(3) * i for i in range(10)], 2).saveAsPickleFile("s3://test-bucket/p", storage_options=s3)
    assert torch.stack(sc.pickleFile("s3://test-bucket/p", storage_options=s3).collect()).sum().item() == 135
    assert dict(sc.wholeTextFiles("s3://test-bucket/lines/part-00000", storage_options=s3).collect())


def test_s3_missing_bucket_is_named(s3: dict, sc: SparkContext) -> None:
    with pytest.raises(StorageError, match="no-such-bucket"):
        sc.textFile("s3://no-such-bucket/x", storage_options=s3)
