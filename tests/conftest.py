"""Shared fixtures: a dlscale context on a real 2-process LocalCluster, a PySpark context to
compare against, and an S3-compatible server (moto) on 127.0.0.1."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import dask.config
import pytest

from dlscale import SparkContext

WORKER_IMPORTS = dask.config.merge(*dask.config.defaults)["dlscale"]["worker"]["imports"]
"""The modules an embedded cluster's workers import as they start, by default."""


def pytest_configure(config: pytest.Config) -> None:
    """The suite starts some ninety contexts, most of which train nothing or a few minibatches: its own
    contexts' workers start without the warm-up imports (they import on first use, as any cluster's
    workers without the preload do); the tests of the warm-up set them back. A hook, not module code:
    a worker that unpickles a test's function imports this module too."""
    dask.config.set({"dlscale.worker.imports": []})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def sc() -> Iterator[SparkContext]:
    """dlscale on ``local[2]``: two worker processes, one thread each."""
    with SparkContext("local[2]", "dlscale-tests") as context:
        yield context


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """PySpark's SparkContext on ``local[2]``, the reference for results."""
    pyspark = pytest.importorskip("pyspark")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("PySpark needs Java 17+")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    conf = (
        pyspark.SparkConf()
        .setMaster("local[2]")
        .setAppName("dlscale-reference")
        .set("spark.ui.enabled", "false")
        .set("spark.executorEnv.PYTHONHASHSEED", "0")
    )
    context = pyspark.SparkContext(conf=conf)
    context.setLogLevel("ERROR")
    yield context
    context.stop()


def _s3_launcher() -> ModuleType:
    """``storage/s3_server.py``, the launcher that examples use too."""
    path = Path(__file__).resolve().parent.parent / "storage" / "s3_server.py"
    spec = importlib.util.spec_from_file_location("s3_server", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 for the whole session."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.moto_server.threaded_moto_server")
    server, endpoint = _s3_launcher().start()
    yield endpoint
    server.stop()


@pytest.fixture
def s3(s3_endpoint: str) -> dict:
    """storage_options for a fresh bucket ``test-bucket`` on the local S3 server."""
    import boto3
    import s3fs

    client = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    for bucket in client.list_buckets().get("Buckets", []):
        objects = client.list_objects_v2(Bucket=bucket["Name"]).get("Contents", [])
        for obj in objects:
            client.delete_object(Bucket=bucket["Name"], Key=obj["Key"])
        client.delete_bucket(Bucket=bucket["Name"])
    client.create_bucket(Bucket="test-bucket")
    s3fs.S3FileSystem.clear_instance_cache()
    return _s3_launcher().storage_options(s3_endpoint)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the tests on distributed's in-process ``gen_cluster`` first: its checks for leaked
    processes and its reset of global clients and config would otherwise meet the session's
    LocalCluster (and break the tests that use it afterwards)."""
    items.sort(key=lambda item: item.get_closest_marker("gen_cluster") is None)
