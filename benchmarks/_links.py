"""Run benchmark code over a loopback link limited in rate, in a network namespace of its own.

A benchmark that compares ways of sharing gradients needs links slower than this machine's loopback
(tens of Gbit/s), so that communication costs what it costs between machines. ``limited_namespace``
creates a network namespace whose ``lo`` goes through a token-bucket filter (``tc qdisc ... tbf``) at
the given rate; every process started in it with ``run_in_namespace`` talks over 127.0.0.1 at that
rate. Needs root, ``ip`` and ``tc`` with ``sch_tbf``; ``available()`` says why not otherwise, so that a
benchmark can skip those links with a message.

Every packet between two processes of the namespace leaves through ``lo`` once, so each direction of
a connection crosses the qdisc once, and **all traffic in the namespace shares the one rate**: two
processes sending to each other at the same time get half the rate each, as on a shared (half-duplex)
medium, not a full-duplex link of that rate per direction per machine. A ring all-reduce among W
processes moves 2(W-1)/W times the gradient bytes out of every process, so over this link it takes
W times as long as over W full-duplex links of the same rate.

Run ``python -m benchmarks._links`` to measure every link in ``LINKS``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Link name -> tc rate (None: loopback left unshaped, though still in a namespace of its own).
LINKS: dict[str, str | None] = {"loopback": None, "1gbit": "1gbit", "100mbit": "100mbit"}

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_MIN_BURST = 256 * 1024  # bytes; see tbf_args


def parse_rate(rate: str) -> float:
    """Bits per second of a tc rate such as ``"1gbit"``, ``"100mbit"`` or ``"500kbit"``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)bit\s*", rate.lower())
    if match is None:
        raise ValueError(f"rate {rate!r} is not of the form <number>[k|m|g|t]bit")
    return float(match.group(1)) * _UNITS[match.group(2)]


def tbf_args(rate: str) -> list[str]:
    """The ``tbf`` qdisc arguments that limit ``lo`` to ``rate``.

    burst: ``lo`` has an MTU of 64 KiB and TCP over it sends packets that large; tbf drops every packet
    larger than its bucket, and a TCP connection whose packets are all dropped stalls until it times
    out (measured here: bursts of 32 KiB and 64 KiB stopped a stream at once). So the bucket holds
    several such packets: at least 256 KiB, or 2 ms at the rate where that is more (fewer timer
    wake-ups at high rates). 256 KiB is 2 ms at 1 Gbit/s and 21 ms at 100 Mbit/s: the only part of a
    transfer that goes faster than the rate, negligible against the megabytes of one gradient exchange.

    latency (the queue's length in time): long enough that a full window of a few TCP connections waits
    in the queue rather than being dropped, since a drop costs a retransmission and at worst a 200 ms
    retransmission timeout, far more than the link's own delay. 50 ms is 6 MB at 1 Gbit/s.
    """
    bits = parse_rate(rate)
    burst = max(_MIN_BURST, int(bits / 8 * 0.002))
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


def _run(argv: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)


def _check(argv: Sequence[str]) -> None:
    result = _run(argv)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")


def _delete(name: str) -> None:
    """Delete the namespace ``name``, not to be interrupted by Ctrl-C halfway (SIGINT waits until done)."""
    main = threading.current_thread() is threading.main_thread()
    if main:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        _run(["ip", "netns", "delete", name])
    finally:
        if main:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextlib.contextmanager
def limited_namespace(rate: str | None, name: str | None = None) -> Iterator[str]:
    """Create a network namespace with ``lo`` up and limited to ``rate`` (None: unlimited); yield its name.

    The namespace is deleted on leaving, whatever the reason (exception, KeyboardInterrupt). A name
    already in use is an error, never reused or deleted. Processes still running inside keep their
    (then nameless) namespace until they end.
    """
    qdisc = tbf_args(rate) if rate is not None else []  # a malformed rate fails before anything exists
    name = name or f"dlscale-bench-{os.getpid()}-{secrets.token_hex(3)}"
    _check(["ip", "netns", "add", name])
    try:
        _check(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"])
        if qdisc:
            _check(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", *qdisc])
        yield name
    finally:
        _delete(name)


def run_in_namespace(
    ns: str, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` inside namespace ``ns`` from the repository root; return its exit status and output.

    A leading ``"python"`` stands for this interpreter (``sys.executable``, so the same virtual
    environment). ``env`` adds to (overrides) this process's environment. The command runs in a process
    group of its own, so on timeout or KeyboardInterrupt it is killed with every process it started
    (such as torch.multiprocessing workers); a timeout then raises ``subprocess.TimeoutExpired``.
    """
    argv = list(argv)
    if argv and argv[0] == "python":
        argv[0] = sys.executable
    full_env = {**os.environ, **(env or {})}
    with subprocess.Popen(
        ["ip", "netns", "exec", ns, *argv],
        cwd=ROOT,
        env=full_env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@functools.cache
def available() -> str | None:
    """None when rate-limited namespaces can be made here, else why not (for a benchmark's skip message).

    Tries it: creates a namespace with a tbf qdisc on ``lo`` and deletes it. Cached for the process.
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces and tc need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (iproute2)"
    name = f"dlscale-probe-{os.getpid()}-{secrets.token_hex(3)}"
    add = _run(["ip", "netns", "add", name])
    if add.returncode != 0:
        return f"cannot create a network namespace (unshare refused?): {add.stderr.strip()}"
    try:
        for argv, what in (
            (["ip", "link", "set", "lo", "up"], "cannot bring lo up in a namespace"),
            (
                ["tc", "qdisc", "add", "dev", "lo", "root", *tbf_args("1gbit")],
                "cannot add a tbf qdisc (sch_tbf missing?)",
            ),
        ):
            result = _run(["ip", "netns", "exec", name, *argv])
            if result.returncode != 0:
                return f"{what}: {result.stderr.strip()}"
    finally:
        _delete(name)
    return None


def _stream(seconds: float, streams: int = 1) -> float:
    """Bits/s received over ``streams`` concurrent TCP connections on 127.0.0.1 sending for ``seconds``.

    Counted at the receivers, from the first byte received to the last (after the senders close), so
    bytes still queued when the senders stop are counted with the time they took to arrive.
    """
    server = socket.create_server(("127.0.0.1", 0), backlog=streams)
    port = server.getsockname()[1]
    received = [0] * streams
    first: list[float] = []
    last: list[float] = []
    errors: list[OSError] = []

    def receive(i: int) -> None:
        try:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(10)
                buf = bytearray(1 << 20)
                while n := conn.recv_into(buf):
                    if not received[i]:
                        first.append(time.perf_counter())
                    received[i] += n
                last.append(time.perf_counter())
        except OSError as e:  # reported by the main thread
            errors.append(e)

    def send() -> None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
                data = bytes(1 << 20)
                end = time.perf_counter() + seconds
                while time.perf_counter() < end:
                    conn.sendall(data)
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=receive, args=(i,), daemon=True) for i in range(streams)]
    threads += [threading.Thread(target=send, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    server.close()
    if errors or any(t.is_alive() for t in threads) or not first:
        raise RuntimeError(f"stream measurement failed: {errors or 'no data within the time limit'}")
    return sum(received) * 8 / (max(last) - min(first))


def measure_throughput(ns: str, seconds: float = 2.0, streams: int = 1) -> float:
    """Bits/s achieved inside namespace ``ns`` by ``streams`` TCP streams over 127.0.0.1 (summed).

    Verifies a link's shaping: one stream should come near the link's rate, and several share it.
    """
    result = run_in_namespace(
        ns,
        ["python", "-m", "benchmarks._links", "--stream", str(seconds), "--streams", str(streams)],
        timeout=seconds + 60,
    )
    if result.returncode != 0:
        raise RuntimeError(f"throughput measurement in {ns} failed: {result.stderr.strip()}")
    return float(json.loads(result.stdout.strip().splitlines()[-1])["bits_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description="Measure the TCP throughput of every link in LINKS.")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument(
        "--stream", type=float, metavar="SECONDS", help="(inside a namespace) measure here and print one JSON line"
    )
    args = parser.parse_args()
    if args.stream is not None:
        print(json.dumps({"bits_per_s": _stream(args.stream, args.streams)}))
        return
    reason = available()
    if reason is not None:
        print(f"rate-limited links unavailable: {reason}")
        return
    for link, rate in LINKS.items():
        with limited_namespace(rate) as ns:
            bits = measure_throughput(ns, args.seconds, args.streams)
        share = f", {bits / parse_rate(rate):.3f} of the rate" if rate else ""
        print(f"{link:9s} {args.streams} stream(s): {bits / 1e6:10.1f} Mbit/s{share}")


if __name__ == "__main__":
    main()
