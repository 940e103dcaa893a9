"""``pipe``, ``sampleByKey``, the approximate actions, ``toDebugString``, ``binaryRecords``, ``runJob``,
``setLogLevel``, ``sparkUser`` and the JVM-only methods, run on dlscale and on PySpark with the same
programs."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark import StorageLevel as SparkStorageLevel

from dlscale import (
    CorruptDataError,
    PipeFunctionExitedError,
    SparkContext,
    StorageLevel,
    UnsupportedOperationError,
)

pytestmark = pytest.mark.pyspark


def both(sc: Any, spark: Any, program: Callable[[Any], Any]) -> Any:
    """``program`` run on PySpark and on dlscale; asserts they agree and returns the result."""
    expected, got = program(spark), program(sc)
    assert got == expected
    return got


def spark_error(spark: Any, program: Callable[[Any], Any]) -> str:
    """The text of the error ``program`` raises on PySpark (with the JVM's exception, where there is one)."""
    with pytest.raises(Exception) as info:
        program(spark)
    java = getattr(info.value, "java_exception", None)
    return f"{info.value} {java.toString() if java is not None else ''}"


# -- pipe ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "program",
    [
        lambda c: c.parallelize(["a\nb", "c\n", 1, None, "é", ""], 2).pipe("cat").glom().collect(),
        lambda c: c.parallelize(range(6), 2).pipe("sh -c 'echo $FOO; cat'", env={"FOO": "bar"}).glom().collect(),
        lambda c: c.parallelize(range(3), 1).pipe("env").collect(),  # the environment is env alone
        lambda c: c.parallelize(range(100_000), 2).pipe("head -n 2").collect(),  # stops reading early
        lambda c: c.parallelize([], 2).pipe("echo hi").collect(),
        lambda c: c.parallelize(range(4), 2).pipe("sh -c 'cat; exit 3'").collect(),  # exit code unchecked
    ],
    ids=["str_lines", "env", "empty_env", "head", "no_input", "exit_unchecked"],
)
def test_pipe(sc: Any, spark: Any, program: Callable[[Any], Any]) -> None:
    both(sc, spark, program)


def test_pipe_check_code_fails_naming_the_command_and_code(sc: Any, spark: Any) -> None:
    def program(c: Any) -> Any:
        return c.parallelize(range(4), 2).pipe("sh -c 'cat; exit 3'", checkCode=True).collect()

    expected = spark_error(spark, program)
    with pytest.raises(PipeFunctionExitedError) as info:
        program(sc)
    assert str(info.value) == "Pipe function `sh -c 'cat; exit 3'` exited with error code 3."
    assert str(info.value) in expected
    assert both(sc, spark, lambda c: c.parallelize(range(4), 2).pipe("cat", checkCode=True).collect())


def test_pipe_fails_with_an_elements_str_error(sc: Any) -> None:
    class Unprintable:
        def __str__(self) -> str:
            raise ValueError("no text for this one")

    with pytest.raises(ValueError, match="no text for this one"):
        sc.parallelize([1, Unprintable(), 2], 1).pipe("cat").collect()


# -- sampleByKey ----------------------------------------------------------------------------------
def keyed(c: Any) -> Any:
    return c.parallelize([(k, i) for i in range(300) for k in "abc"], 3)


@pytest.mark.parametrize("with_replacement", [False, True])
@pytest.mark.parametrize("seed", [0, 7, 123456789])
def test_sample_by_key_same_elements_as_pyspark(sc: Any, spark: Any, with_replacement: bool, seed: int) -> None:
    # "c" at 25 draws Poisson counts through PySpark's other branch (mean >= 20)
    fractions = {"a": 0.1, "b": 0.5, "c": 25.0 if with_replacement else 1.0}
    sample = both(sc, spark, lambda c: keyed(c).sampleByKey(with_replacement, fractions, seed).glom().collect())
    assert any(sample)


def test_sample_by_key_refuses_a_negative_fraction_as_pyspark(sc: Any, spark: Any) -> None:
    expected = spark_error(spark, lambda c: keyed(c).sampleByKey(False, {"a": 0.5, "b": -0.1}))
    with pytest.raises(ValueError) as info:
        keyed(sc).sampleByKey(False, {"a": 0.5, "b": -0.1})
    assert str(info.value) == "Negative fraction value: -0.1"
    assert str(info.value) in expected


# -- approximate actions --------------------------------------------------------------------------
def bounded(x: Any) -> tuple[float, float, float, float]:
    return float(x), x.confidence, x.low, x.high


@pytest.mark.parametrize(
    "data",
    [lambda c: c.parallelize(range(1000), 10), lambda c: c.parallelize([0.5, 2.25, -1.0], 4), lambda c: c.emptyRDD()],
    ids=["ints", "floats_and_an_empty_partition", "no_partitions"],
)
def test_approx_actions_are_exact_when_every_partition_finishes(sc: Any, spark: Any, data: Callable) -> None:
    assert both(sc, spark, lambda c: data(c).countApprox(60_000)) == data(sc).count()
    for method in ("sumApprox", "meanApprox"):
        got = getattr(data(sc), method)(60_000, 0.9)
        expected = getattr(data(spark), method)(60_000, 0.9)
        assert bounded(got) == pytest.approx(bounded(expected), rel=1e-12)
        assert got.low == got.high == float(got) and got.confidence == 1.0  # exact, as Spark's
    assert float(data(sc).sumApprox(60_000)) == data(sc).sum()


@pytest.fixture(scope="module")
def four_threads() -> Iterator[SparkContext]:
    """A dlscale context whose four threads start every partition of a four-partition RDD at once, so that
    the slow one keeps no other waiting (as none waits on PySpark's local[2], which runs them in order)."""
    with SparkContext("local[1]", "approx", conf={"spark.executor.cores": "4"}) as context:
        yield context


def slow_last(seconds: float) -> Callable[[int, Iterator[float]], Iterator[float]]:
    """A partition function under which partition 3 takes ``seconds`` (in short sleeps, so that a cancelled
    task can be interrupted between them) and the others none."""

    def f(i: int, it: Iterator[float]) -> Iterator[float]:
        if i == 3:
            for _ in range(int(seconds / 0.05)):
                time.sleep(0.05)
        return it

    return f


def uneven(c: Any, seconds: float) -> Any:
    """Partitions [1, 2], [3, 4], [5, 6], [7, 8]; the last takes ``seconds``."""
    return c.parallelize([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], 4).mapPartitionsWithIndex(slow_last(seconds))


def running_tasks(context: SparkContext) -> list:
    return [
        k
        for keys in context.client.run(lambda dask_worker: list(dask_worker.active_threads.values())).values()
        for k in keys
    ]


@pytest.mark.parametrize("confidence", [0.95, 0.5])
def test_approx_actions_estimate_from_the_partitions_done_at_the_timeout(
    four_threads: SparkContext, spark: Any, confidence: float
) -> None:
    spark.parallelize([0], 1).count()  # PySpark's Python workers started before the clock runs
    for method in ("sumApprox", "meanApprox", "countApprox"):
        expected = getattr(uneven(spark, 4.0), method)(2000, confidence)
        start = time.monotonic()
        got = getattr(uneven(four_threads, 60.0), method)(2000, confidence)
        took = time.monotonic() - start
        assert 2.0 <= took < 10.0
        if method == "countApprox":
            assert isinstance(got, int) and got == expected == 8  # 6 counted in 3 of 4 partitions
            continue
        # partitions 0, 1 and 2 done: the same estimate and interval (Spark's t quantile is within 1e-9)
        assert bounded(got) == pytest.approx(bounded(expected), rel=1e-8)
        assert got.confidence == confidence and got.low < float(got) < got.high
        # the slow partition was interrupted, not left to run for its minute
        deadline = time.monotonic() + 5
        while running_tasks(four_threads) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert running_tasks(four_threads) == []


def test_approx_intervals_contain_the_true_values(four_threads: SparkContext) -> None:
    """Whichever three of the four partitions [1, 2], [3, 4], [5, 6], [7, 8] are in, the 95% intervals hold
    the true sum 36 and mean 4.5: the widest miss is the mean of 3..8 (5.5, t(5) half-width 1.96) and the
    sum from 7, 11, 15 (44, t(2) half-width about 57)."""

    def ticket_last(tickets: Path) -> Callable[[int, Iterator[float]], Iterator[float]]:
        def f(i: int, it: Iterator[float]) -> Iterator[float]:
            n = 0
            while True:  # the partition to start last is the slow one, whatever its index
                try:
                    os.close(os.open(tickets / str(n), os.O_CREAT | os.O_EXCL))
                    break
                except FileExistsError:
                    n += 1
            if n == 3:
                for _ in range(1200):
                    time.sleep(0.05)
            return it

        return f

    for method, truth in (("sumApprox", 36.0), ("meanApprox", 4.5)):
        tickets = Path(os.environ.get("TMPDIR", "/tmp")) / f"dlscale-tickets-{os.getpid()}-{method}"
        tickets.mkdir()
        try:
            rdd = four_threads.parallelize([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], 4)
            got = getattr(rdd.mapPartitionsWithIndex(ticket_last(tickets)), method)(1500)
        finally:
            for f in tickets.iterdir():
                f.unlink()
            tickets.rmdir()
        assert got.confidence == 0.95 and got.low < truth < got.high
        assert float(got) != truth  # an estimate: no three partitions give the exact value


def test_approx_actions_check_confidence(sc: Any) -> None:
    with pytest.raises(ValueError, match=r"confidence \(1.5\) must be in \[0,1\]"):
        sc.parallelize([1]).sumApprox(1000, 1.5)


# -- toDebugString ---------------------------------------------------------------------------------
LINE = re.compile(
    r"^(?P<indent>[ |+\-]*)(?:\((?P<n>\d+)\) )?(?:\S+ )?(?P<kind>\w+RDD)\[(?P<id>\d+)\] at .* \[(?P<level>.*)\]$"
)


def lineage(text: bytes) -> list[re.Match]:
    """The RDD lines of a debug string (the lines about cached partitions left out)."""
    lines = text.decode("utf-8").splitlines()
    return [m for line in lines if (m := LINE.match(line))]


def test_to_debug_string_shows_the_lineage_as_spark(sc: Any, spark: Any) -> None:
    def program(c: Any) -> tuple[Any, bytes]:
        rdd = c.parallelize(range(10), 2).map(lambda x: (x % 3, x)).filter(bool).reduceByKey(lambda a, b: a + b)
        return rdd, rdd.toDebugString()

    (rdd, got), (_, expected) = program(sc), program(spark)
    assert isinstance(got, bytes)
    assert got.startswith(f"(2) PythonRDD[{rdd.id()}] at ".encode())
    mine, theirs = lineage(got), lineage(expected)
    # one shuffle, shown as an indented "+-(2)" block, down to the parallelized collection
    assert [m["n"] for m in mine if "+-" in m["indent"]] == [m["n"] for m in theirs if "+-" in m["indent"]] == ["2"]
    assert mine[-1]["kind"] == theirs[-1]["kind"] == "ParallelCollectionRDD"
    assert mine[-1]["indent"] == theirs[-1]["indent"] == "    |  "
    assert len({m["id"] for m in mine}) == len(mine)  # every RDD shown with its own id


def test_to_debug_string_shows_persisted_rdds(sc: Any, spark: Any) -> None:
    def program(c: Any, level: Any) -> tuple[Any, list[str]]:
        rdd = c.parallelize(range(10), 2).map(lambda x: x + 1).setName("plus one").persist(level.DISK_ONLY)
        rdd.count()
        return rdd, rdd.toDebugString().decode().splitlines()

    (rdd, got), (_, expected) = program(sc, StorageLevel), program(spark, SparkStorageLevel)
    for lines in (got, expected):
        assert re.fullmatch(r"\(2\) plus one PythonRDD\[\d+\] at .* \[Disk Serialized 1x Replicated\]", lines[0])
        assert re.fullmatch(r" \|       CachedPartitions: 2; MemorySize: 0\.0 B; DiskSize: \d+\.\d (B|KiB)", lines[1])
    assert f"PythonRDD[{rdd.id()}]" in got[0]
    union = rdd.union(sc.parallelize([1], 1)).toDebugString().decode()
    assert "[Disk Serialized 1x Replicated]" in union and union.startswith("(3) UnionRDD[")
    rdd.unpersist()


# -- SparkContext ----------------------------------------------------------------------------------
def test_binary_records(sc: Any, spark: Any, tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(bytes(range(12)))
    (tmp_path / "b.bin").write_bytes(bytes(range(100, 108)))
    (tmp_path / "_hidden.bin").write_bytes(bytes(range(50, 54)))
    (tmp_path / "empty.bin").write_bytes(b"")
    records = both(sc, spark, lambda c: sorted(c.binaryRecords(str(tmp_path), 4).collect()))
    assert len(records) == 5 and all(isinstance(r, bytes) and len(r) == 4 for r in records)
    both(sc, spark, lambda c: c.binaryRecords(str(tmp_path), 4).getNumPartitions())  # none for the empty file
    both(sc, spark, lambda c: c.binaryRecords(str(tmp_path / "a.bin"), 3).glom().collect())
    assert sc.binaryRecords(f"file://{tmp_path}/b.bin", 8).collect() == [bytes(range(100, 108))]


def test_binary_records_refuses_a_partial_record(sc: Any, tmp_path: Path) -> None:
    (tmp_path / "odd.bin").write_bytes(bytes(10))
    with pytest.raises(CorruptDataError, match=r"odd\.bin has 10 bytes, not a whole number of 4-byte records"):
        sc.binaryRecords(str(tmp_path), 4)
    with pytest.raises(ValueError, match="recordLength must be positive"):
        sc.binaryRecords(str(tmp_path), 0)


def test_binary_records_on_fsspec_storage(sc: Any, s3: dict) -> None:
    import fsspec

    fs = fsspec.filesystem("s3", **s3)
    fs.pipe("test-bucket/records/part-0", bytes(range(16)))
    rdd = sc.binaryRecords("s3://test-bucket/records", 8, storage_options=s3)
    assert rdd.collect() == [bytes(range(8)), bytes(range(8, 16))]


def test_run_job(sc: Any, spark: Any) -> None:
    def squares(c: Any, *partitions: Any) -> Any:
        return c.runJob(c.parallelize(range(6), 3), lambda part: [x * x for x in part], *partitions)

    assert both(sc, spark, squares) == [0, 1, 4, 9, 16, 25]
    assert both(sc, spark, lambda c: squares(c, [2, 0], True)) == [16, 25, 0, 1]
    expected = spark_error(spark, lambda c: squares(c, [5]))
    with pytest.raises(ValueError) as info:
        squares(sc, [5])
    assert str(info.value) == "Attempting to access a non-existent partition: 5. Total number of partitions: 3"
    assert str(info.value) in expected


@pytest.fixture
def log_levels() -> Iterator[None]:
    """Puts the driver's ``dlscale`` and ``distributed`` logger levels back after the test."""
    levels = {name: logging.getLogger(name).level for name in ("dlscale", "distributed")}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_set_log_level(sc: Any, spark: Any, log_levels: None) -> None:
    scheduler_log = logging.getLogger("distributed.scheduler")
    for level, shown, hidden in (("TRACE", logging.DEBUG, None), ("error", logging.ERROR, logging.WARNING)):
        both(sc, spark, lambda c, level=level: c.setLogLevel(level))
        for name in ("dlscale", "distributed"):
            assert logging.getLogger(name).isEnabledFor(shown)
        assert scheduler_log.isEnabledFor(shown)
        assert hidden is None or not scheduler_log.isEnabledFor(hidden)
    sc.setLogLevel("OFF")
    assert not logging.getLogger("dlscale.persist").isEnabledFor(logging.CRITICAL)
    expected = spark_error(spark, lambda c: c.setLogLevel("LOUD"))
    with pytest.raises(ValueError) as info:
        sc.setLogLevel("LOUD")
    assert str(info.value) in expected


def test_spark_user(sc: Any, spark: Any) -> None:
    assert both(sc, spark, lambda c: c.sparkUser())


# -- what needs Spark's JVM ------------------------------------------------------------------------
def test_jvm_only_methods_name_the_alternative(sc: Any) -> None:
    rdd = sc.parallelize([("a", 1)])
    calls = {
        "dataframe": [lambda: rdd.toDF(), lambda: rdd.toDF(["k", "v"])],
        "saveAsPickleFile": [
            lambda: rdd.saveAsHadoopFile("/tmp/x", "org.apache.hadoop.mapred.TextOutputFormat"),
            lambda: rdd.saveAsNewAPIHadoopFile("/tmp/x", "org.apache.hadoop.mapreduce.lib.output.TextOutputFormat"),
            lambda: rdd.saveAsSequenceFile("/tmp/x"),
            lambda: rdd.saveAsHadoopDataset({}),
            lambda: rdd.saveAsNewAPIHadoopDataset({}),
        ],
        "binaryFiles": [
            lambda: sc.hadoopFile("/tmp/x", "TextInputFormat", "LongWritable", "Text"),
            lambda: sc.hadoopRDD("TextInputFormat", "LongWritable", "Text"),
            lambda: sc.newAPIHadoopFile("/tmp/x", "TextInputFormat", "LongWritable", "Text"),
            lambda: sc.newAPIHadoopRDD("TextInputFormat", "LongWritable", "Text"),
            lambda: sc.sequenceFile("/tmp/x"),
        ],
        "spark.executor.resource": [lambda: rdd.withResources(None), lambda: rdd.getResourceProfile()],
    }
    for alternative, programs in calls.items():
        for program in programs:
            with pytest.raises(UnsupportedOperationError, match=re.escape(alternative)) as info:
                program()
            assert isinstance(info.value, NotImplementedError)
    assert not os.path.exists("/tmp/x")


def test_to_df_alternative_works(sc: Any) -> None:
    pytest.importorskip("dask.dataframe")
    frame = sc.parallelize([("a", 1), ("b", 2)], 2).to_bag().to_dataframe(columns=["k", "v"]).compute()
    assert list(frame["k"]) == ["a", "b"] and list(frame["v"]) == [1, 2]
