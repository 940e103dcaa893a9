"""Checkpoints of fits and resuming from them: DL4J's CheckpointListener options, the keep policy, a resumed
parameter-averaging fit equal to the uninterrupted one, gradient sharing resumed in segments, a driver
SIGKILLed mid-fit and resumed in a new process, and the main job's ``--resume``."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import dask
import pytest
import torch

from dlscale import (
    CheckpointListener,
    ParameterAveragingTrainingMaster,
    SharedTrainingMaster,
    SparkContext,
    SparkNet,
)
from dlscale.data import DataSet
from dlscale.nn import Network
from dlscale.training.checkpoints import available_checkpoints, load_checkpoint


def _net() -> Network:
    torch.manual_seed(0)
    return Network(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)),
        "cross_entropy",
        functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
    )


def _rdd(sc: SparkContext, n: int = 640) -> Any:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return sc.parallelize(DataSet(x, y).batch_by(64), 2)


def test_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="give save_every_n_iterations, save_every_n_epochs or save_every"):
        CheckpointListener(str(tmp_path))
    with pytest.raises(ValueError, match="keep_last must be a positive integer or None, got 0"):
        CheckpointListener(str(tmp_path), save_every_n_epochs=1, keep_last=0)
    listener = CheckpointListener(str(tmp_path), save_every="2 minutes")
    assert listener.every_seconds == 120
    assert listener.available_checkpoints() == [] and listener.last_checkpoint() is None


def test_keep_last_and_every(tmp_path: Path) -> None:
    from dlscale.training.checkpoints import FitPosition

    listener = CheckpointListener(str(tmp_path), save_every_n_iterations=1, keep_last=2, keep_every=3)
    network = _net()
    for i in range(8):
        network.iteration = i
        listener.save(network, FitPosition("parameter averaging", 7, 0, 1, 10, 0, i))
    assert [c.number for c in listener.available_checkpoints()] == [2, 5, 6, 7]
    saved, position = load_checkpoint(listener.last_checkpoint().url, like=_net())
    assert position.rounds == 7 and position.seed == 7 and saved.iteration == 7
    assert torch.equal(saved.params(), network.params())


def test_a_checkpoint_removes_what_a_writer_killed_before_it_left(tmp_path: Path) -> None:
    """A driver killed while writing a checkpoint leaves its hidden temporary file: the next checkpoint
    in that folder removes it (old enough to be nobody's work in progress), and keeps a fresh one."""
    from dlscale.training.checkpoints import FitPosition

    old = tmp_path / f".checkpoint-000000-epoch0-iteration0.dln.{'a' * 32}.tmp"
    fresh = tmp_path / f".checkpoint-000001-epoch0-iteration1.dln.{'b' * 32}.tmp"
    for file in (old, fresh):
        file.write_bytes(b"half a checkpoint")
    os.utime(old, (0, 0))
    CheckpointListener(str(tmp_path), save_every_n_epochs=1).save(
        _net(), FitPosition("parameter averaging", 7, 0, 1, 10, 0, 0)
    )
    assert not old.exists() and fresh.exists()


def test_averaging_resumed_from_any_checkpoint_ends_as_the_uninterrupted_fit(sc: SparkContext, tmp_path: Path) -> None:
    rdd = _rdd(sc)
    listener = CheckpointListener(str(tmp_path), save_every_n_iterations=8)
    whole = _net()
    spark_net = SparkNet(sc, whole, ParameterAveragingTrainingMaster(16, averaging_frequency=2, rng_seed=1))
    spark_net.set_listeners(listener)
    spark_net.fit(rdd, epochs=3)
    checkpoints = listener.available_checkpoints()
    # 20 minibatches an epoch in rounds of 4: a checkpoint at the first round's end past each 8 iterations
    assert [c.iteration for c in checkpoints] == [8, 16, 24, 32, 40, 48, 56]
    assert [c.epoch for c in checkpoints] == [0, 0, 1, 1, 2, 2, 2]
    for checkpoint in checkpoints[::3]:
        resumed = _net()
        SparkNet(sc, resumed, ParameterAveragingTrainingMaster(16, averaging_frequency=2)).fit(
            rdd, epochs=3, resume_from=checkpoint.url
        )
        assert (resumed.iteration, resumed.epoch) == (60, 3)
        assert torch.equal(resumed.params(), whole.params()), checkpoint


def test_a_fit_goes_on_after_each_checkpoint_with_its_trainers_parked(
    sc: SparkContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment after a checkpoint goes on with the replicas its trainers parked: the network is sent
    once for the fit, where without parked trainers it is sent again for each of its 7 segments after
    the first, and both fits end alike."""
    from dlscale.training._driver import FitRun

    sent: list[int] = []
    reship = FitRun.reship
    monkeypatch.setattr(FitRun, "reship", lambda run: (sent.append(1), reship(run))[1])
    rdd, nets = _rdd(sc), []
    for keep in (True, False):
        sent.clear()
        nets.append(_net())
        spark_net = SparkNet(sc, nets[-1], ParameterAveragingTrainingMaster(16, averaging_frequency=2, rng_seed=1))
        spark_net.set_listeners(CheckpointListener(str(tmp_path / str(keep)), save_every_n_iterations=8))
        with dask.config.set({"dlscale.training.keep-trainers": keep}):
            spark_net.fit(rdd, epochs=3)
        assert len(sent) == (0 if keep else 7)
    assert torch.equal(nets[0].params(), nets[1].params())


@pytest.mark.parametrize("streaming", [False, True], ids=["rounds", "streaming"])
def test_checkpoints_at_epochs_ends_are_written_while_the_trainers_go_on(
    sc: SparkContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, streaming: bool
) -> None:
    """A checkpoint at each epoch's end is written from the average the trainers kept aside there, and the
    fit goes on in its one session; each is the network at its epoch's end: a fit resumed from it ends as
    the uninterrupted one (rounds; streaming rounds take averages when they come, so there it ends
    at the same place, after the same minibatches)."""
    from dlscale.training._session import SessionRun

    segments: list[int] = []
    segment = SessionRun._segment
    monkeypatch.setattr(SessionRun, "_segment", lambda run, order: (segments.append(1), segment(run, order))[1])
    rdd, whole = _rdd(sc), _net()
    master = functools.partial(ParameterAveragingTrainingMaster, 16, averaging_frequency=4, streaming=streaming)
    listener = CheckpointListener(str(tmp_path), save_every_n_epochs=1)
    spark_net = SparkNet(sc, whole, master(rng_seed=1))
    spark_net.set_listeners(listener)
    spark_net.fit(rdd, epochs=3)
    assert len(segments) == 1
    checkpoints = listener.available_checkpoints()
    # a checkpoint at each epoch's end (20 iterations an epoch), the last the fit's
    assert [(c.epoch, c.iteration) for c in checkpoints] == [(1, 20), (2, 40), (3, 60)]
    saved, _ = load_checkpoint(checkpoints[-1].url, like=_net())
    assert torch.equal(saved.params(), whole.params())
    for checkpoint in checkpoints[:2]:
        resumed = _net()
        SparkNet(sc, resumed, master()).fit(rdd, epochs=3, resume_from=checkpoint.url)
        assert (resumed.iteration, resumed.epoch) == (60, 3)
        if not streaming:
            assert torch.equal(resumed.params(), whole.params()), checkpoint


def test_a_checkpoint_from_a_kept_average_drops_the_other_workers_copies(
    sc: SparkContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a checkpoint is written from the average one worker kept aside at an epoch's end, no worker
    holds that average any longer: the others drop their copies while the fit goes on."""
    from dlscale.training.averaging._worker_plugin import plugin
    from dlscale.training.averaging.master import _Averaging

    def kept(dask_worker: Any = None) -> list[int]:
        return sorted(r for rounds in plugin(dask_worker).snapshots.values() for r in rounds)

    left: list[dict[str, list[int]]] = []
    write = _Averaging._write_snapshot

    def written(run: _Averaging, report: dict[str, Any], due: list[Any]) -> bool:
        wrote = write(run, report, due)
        if wrote:  # the fit's session is open until the driver closes it, after this
            deadline, held = time.monotonic() + 5, sc.client.run(kept)
            while any(report["round"] in r for r in held.values()) and time.monotonic() < deadline:
                time.sleep(0.02)
                held = sc.client.run(kept)
            left.append({w: [r for r in rounds if r <= report["round"]] for w, rounds in held.items()})
        return wrote

    monkeypatch.setattr(_Averaging, "_write_snapshot", written)
    spark_net = SparkNet(sc, _net(), ParameterAveragingTrainingMaster(16, averaging_frequency=4, rng_seed=1))
    spark_net.set_listeners(CheckpointListener(str(tmp_path), save_every_n_epochs=1))
    spark_net.fit(_rdd(sc), epochs=3)
    assert len(left) == 3  # a checkpoint from a kept average at each epoch's end
    assert all(held == {w: [] for w in held} for held in left)


def test_a_checkpoint_of_another_fit_is_refused(sc: SparkContext, tmp_path: Path) -> None:
    rdd = _rdd(sc)
    listener = CheckpointListener(str(tmp_path), save_every_n_epochs=1)
    spark_net = SparkNet(sc, _net(), ParameterAveragingTrainingMaster(16, rng_seed=1))
    spark_net.set_listeners(listener)
    spark_net.fit(rdd, epochs=1)
    url = listener.last_checkpoint().url
    with pytest.raises(ValueError, match="another training master"):
        SparkNet(sc, _net(), SharedTrainingMaster(16)).fit(rdd, epochs=1, resume_from=url)
    with pytest.raises(ValueError, match=r"another number of minibatches \(40, this fit has 20\)"):
        SparkNet(sc, _net(), ParameterAveragingTrainingMaster(16)).fit(_rdd(sc, 320), epochs=1, resume_from=url)
    network = _net()
    network.save(str(tmp_path / "plain.dln"))
    with pytest.raises(ValueError, match="is a network archive, not a checkpoint of a fit"):
        SparkNet(sc, _net(), ParameterAveragingTrainingMaster(16)).fit(rdd, resume_from=str(tmp_path / "plain.dln"))


def test_sharing_checkpoints_end_a_segment_and_resume_the_rest(sc: SparkContext, tmp_path: Path) -> None:
    rdd = _rdd(sc, 1280)
    listener = CheckpointListener(str(tmp_path), save_every_n_epochs=1)
    whole = _net()
    spark_net = SparkNet(sc, whole, SharedTrainingMaster(16, rng_seed=1, collect_training_stats=True))
    spark_net.set_listeners(listener)
    with dask.config.set({"dlscale.training.poll-interval": "300ms"}):  # a driver that hears of progress late
        spark_net.fit(rdd, epochs=3)
    per_epoch = 1280 // 16  # minibatches, each one iteration
    assert (whole.iteration, whole.epoch) == (3 * per_epoch, 3)
    checkpoints = listener.available_checkpoints()
    assert [c.iteration for c in checkpoints] == [per_epoch, 2 * per_epoch, 3 * per_epoch]  # each epoch's end
    first = checkpoints[0]
    _, position = load_checkpoint(first.url, like=_net())
    assert len(position.remaining) == 3 * per_epoch - first.iteration  # what the checkpoint had not fitted
    resumed = _net()
    SparkNet(sc, resumed, SharedTrainingMaster(16)).fit(rdd, epochs=3, resume_from=first.url)
    assert (resumed.iteration, resumed.epoch) == (3 * per_epoch, 3)
    # a longer fit from the last checkpoint: one more epoch, in the order a 4-epoch fit would have
    longer = _net()
    SparkNet(sc, longer, SharedTrainingMaster(16)).fit(rdd, epochs=4, resume_from=checkpoints[-1].url)
    assert (longer.iteration, longer.epoch) == (4 * per_epoch, 4)


_JOB = textwrap.dedent(
    """
    import functools, sys, torch
    from dlscale import CheckpointListener, ParameterAveragingTrainingMaster, SparkContext, SparkNet
    from dlscale.data import DataSet
    from dlscale.nn import Network

    class Slow(torch.nn.Module):  # a step slow enough for the test to stop the driver mid-fit
        def __init__(self, delay):
            super().__init__()
            self.delay = delay
            self.layers = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        def forward(self, x):
            import time
            time.sleep(self.delay)
            return self.layers(x)

    torch.manual_seed(0)
    net = Network(Slow(float(sys.argv[3])), "cross_entropy", functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    with SparkContext("local[2]", "checkpointed") as sc:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(640, 8, generator=g)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
        rdd = sc.parallelize(DataSet(x, y).batch_by(64), 2)
        spark_net = SparkNet(sc, net, ParameterAveragingTrainingMaster(16, averaging_frequency=2, rng_seed=5))
        spark_net.set_listeners(CheckpointListener(sys.argv[1], save_every_n_iterations=8))
        resume = sys.argv[2] or None
        spark_net.fit(rdd, epochs=3, resume_from=resume)
        accuracy = spark_net.evaluate(rdd).accuracy()
        print("RESULT", net.iteration, net.epoch, accuracy, flush=True)
    """
)


def _descendants(pid: int) -> set[int]:
    out, stack = set(), [pid]
    while stack:
        p = stack.pop()
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for c in map(int, children):
            out.add(c)
            stack.append(c)
    return out


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if "State:\tZ" not in status:
            alive.add(pid)
    return alive


@pytest.mark.slow  # three drivers, each starting its cluster: about 50 s
def test_a_driver_killed_mid_fit_frees_its_workers_and_the_fit_resumes_in_a_new_process(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    directory = tmp_path / "checkpoints"
    env = {**os.environ, "DASK_DLSCALE__PROGRESS": "false"}
    driver = subprocess.Popen(
        [sys.executable, str(script), str(directory), "", "0.05"], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not available_checkpoints(str(directory)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert available_checkpoints(str(directory)), "no checkpoint was written"
        workers = _descendants(driver.pid)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(30)
    finally:
        driver.kill()
    killed_at = time.monotonic()
    while _alive(workers) and time.monotonic() - killed_at < 10:
        time.sleep(0.1)
    assert not _alive(workers), "the driver's worker processes outlived it"
    last = available_checkpoints(str(directory))[-1]
    assert 0 < last.iteration < 60

    def run(resume: str, checkpoints: Path) -> list[str]:
        out = subprocess.run(
            [sys.executable, str(script), str(checkpoints), resume, "0"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        ).stdout
        return next(line for line in out.splitlines() if line.startswith("RESULT")).split()[1:]

    iteration, epoch, accuracy = run(last.url, directory)
    whole_iteration, whole_epoch, whole_accuracy = run("", tmp_path / "uninterrupted")
    assert (iteration, epoch) == (whole_iteration, whole_epoch) == ("60", "3")  # the planned minibatches
    assert abs(float(accuracy) - float(whole_accuracy)) <= 0.01


def test_the_main_job_resumes_from_its_last_checkpoint(tmp_path: Path) -> None:
    storage = tmp_path / "demo"
    env = {**os.environ, "DASK_DLSCALE__PROGRESS": "false"}
    command = [sys.executable, "-m", "dlscale.demo", "--storage", str(storage)]
    subprocess.run([*command, "--epochs", "1"], env=env, capture_output=True, check=True, timeout=300)
    assert [c.epoch for c in available_checkpoints(str(storage / "checkpoints"))] == [1]
    out = subprocess.run(
        [*command, "--epochs", "2", "--resume"], env=env, capture_output=True, text=True, check=True, timeout=300
    ).stdout
    assert "resuming from" in out and "checkpoint-000000-epoch1-iteration" in out
    assert [c.epoch for c in available_checkpoints(str(storage / "checkpoints"))] == [1, 2]
    empty = subprocess.run(
        [sys.executable, "-m", "dlscale.demo", "--storage", str(tmp_path / "none"), "--resume"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert empty.returncode == 2 and "there is no checkpoint under" in empty.stderr
