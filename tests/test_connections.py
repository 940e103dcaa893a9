"""The embedded cluster's network exposure, and connection errors that say what went wrong."""

from __future__ import annotations

import ssl
import urllib.parse
from collections.abc import Iterator

import dask
import distributed
import psutil
import pytest
from distributed.comm.core import FatalCommClosedError

from dlscale import ClusterConnectionError, MasterURLError, SparkContext
from dlscale.facade.context import _cause, _dashboard_address


def _listening(pid: int, port: int) -> set[str]:
    """The addresses the process ``pid`` listens on at ``port``."""
    conns = psutil.Process(pid).net_connections("tcp")
    return {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_embedded_dashboard_listens_on_loopback_only(sc: SparkContext) -> None:
    port = urllib.parse.urlsplit(sc.uiWebUrl).port
    scheduler_pid = sc.client.run_on_scheduler(lambda: psutil.Process().pid)
    assert _listening(scheduler_pid, port) == {"127.0.0.1"}


@pytest.mark.parametrize(
    ("setting", "address"),
    [
        (":0", "127.0.0.1:0"),
        (None, None),
        (8787, "127.0.0.1:8787"),
        ("8787", "127.0.0.1:8787"),
        ("0.0.0.0:8787", "0.0.0.0:8787"),
    ],
)
def test_dashboard_setting_without_a_host_binds_loopback(setting: object, address: str) -> None:
    assert _dashboard_address(setting) == address


@pytest.fixture(scope="module")
def plain_scheduler() -> Iterator[str]:
    """A scheduler that speaks plain TCP on 127.0.0.1, with no workers."""
    with distributed.LocalCluster(
        n_workers=0, processes=False, protocol="tcp://", host="127.0.0.1", dashboard_address=None
    ) as cluster:
        yield cluster.scheduler_address


def test_tls_master_against_a_plaintext_scheduler_says_why(plain_scheduler: str) -> None:
    pytest.importorskip("cryptography")
    address = plain_scheduler.replace("tcp://", "tls://")
    with (
        dask.config.set({"dlscale.connect-timeout": "2s"}),
        pytest.raises(ClusterConnectionError) as e,
    ):
        SparkContext(address, security=distributed.Security.temporary())
    message = str(e.value)
    assert address in message
    assert "TLS handshake" in message and plain_scheduler in message  # what failed and the address to use
    assert "SSL" in message  # the cause: Dask's own error has no text, the SSL error under it does


def test_a_connection_error_without_text_is_described_by_its_type_and_cause() -> None:
    try:
        try:
            raise ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number")
        except ssl.SSLError as e:
            raise FatalCommClosedError() from e
    except FatalCommClosedError as e:
        assert _cause(e) == "FatalCommClosedError(), from SSLError: [SSL: WRONG_VERSION_NUMBER] wrong version number"
    assert _cause(OSError()) == "OSError()"


@pytest.mark.parametrize("master", ["tcp://127.0.0.1:port", "tls://[::1:8786"])
def test_malformed_scheduler_address_is_a_master_url_error(master: str) -> None:
    with pytest.raises(MasterURLError, match="not a valid scheduler address") as e:
        SparkContext(master)
    assert master in str(e.value)
