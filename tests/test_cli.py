"""The ``dlscale`` command: each subcommand on real clusters and files, usage errors that name the
flag at fault, user errors in one line, plain help, and the documented evaluate flow end to end
through the command in a subprocess."""

from __future__ import annotations

import contextlib
import json
import logging
import logging.handlers
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from dlscale import SparkContext, __version__, cli, demo
from dlscale.data import DataSet, export_minibatches, list_paths, load, load_digits
from dlscale.demo import digits_cnn
from dlscale.evaluation import BaseEvaluation, Evaluation
from dlscale.nn import build

ROOT = Path(__file__).resolve().parent.parent


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run"], "script"),
        (["run", "job.py", "--workers", "two"], "argument --workers: expected a positive integer"),
        (["run", "job.py", "--threads-per-worker", "0"], "argument --threads-per-worker"),
        (["run", "job.py", "--resources", "GPU"], "argument --resources: expected NAME=AMOUNT"),
        (["run", "job.py", "--bogus"], "unrecognized arguments: --bogus"),
        (["export", "a.npz"], "destination"),
        (["evaluate", "m.dln", "data", "--top-n", "x"], "argument --top-n"),
        (["info", "--", "extra"], "only 'dlscale run' passes arguments after --"),
        (["run", "job.py", "--epochs", "3"], "unrecognized arguments: --epochs"),
        (["run", "job.py", "3"], "the script's own arguments go after --: 3"),
        (["launch"], "invalid choice: 'launch'"),
    ],
)
def test_usage_errors_name_the_flag(capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_run_hands_the_cluster_flags_to_the_script(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import json, sys
        from dlscale import SparkContext
        from dlscale.runtime.cluster import cluster_workers

        if __name__ == "__main__":
            with SparkContext() as sc:
                workers = cluster_workers(sc.client).values()
                facts = {"master": sc.master, "argv": sys.argv[1:],
                         "workers": [(w["nthreads"], w["memory_limit"], w["resources"]) for w in workers]}
            open(sys.argv[-1], "w").write(json.dumps(facts))
    """)
    )
    out = tmp_path / "facts.json"
    code = cli.main(
        [
            "run",
            str(script),
            "--master",
            "local[1]",
            "--workers",
            "2",
            "--threads-per-worker",
            "1",
            "--worker-memory",
            "1GB",
            "--resources",
            "GPU=1",
            "--",
            "--flag",
            str(out),
        ]
    )
    assert code == 0
    facts = json.loads(out.read_text())
    assert facts["master"] == "local[1]"
    assert facts["argv"] == ["--flag", str(out)]
    assert facts["workers"] == [[1, 2**30, {"GPU": 1.0}]] * 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "missing.py"], "argument script: no such file: missing.py"),
        (["run", "job.py", "--worker-memory", "lots"], "argument --worker-memory: "),
        (["export", "missing.npz", "out"], "argument source: cannot read missing.npz as .npz: "),
        (["evaluate", "missing.dln", "data"], "network archive not found: missing.dln"),
        (["predict", "m.dln", "data", "out", "--import", "no_such_module"], "argument --import: cannot import"),
        (["certify", "missing.py", "--kill-every", "5s"], "argument script: no such file: missing.py"),
        (["certify", "--kill-every", "5s"], "argument script: give the script to certify, or -m MODULE"),
        (["certify", "job.py", "-m", "dlscale.demo", "--kill-every", "5s"], "argument -m: give a script or -m"),
        (["certify", "-m", "no_such_module_here", "--kill-every", "5s"], "argument -m: no module named"),
        (["certify", "job.py", "--kill-every", "5s", "--workers", "1"], "argument --workers: certify needs at least 2"),
        (["certify", "job.py", "--kill-every", "5s", "--stop-for", "1s"], "argument --stop-for: needs --stop-every"),
        (["certify", "job.py", "--kill-every", "5s", "--stop-every", "9s"], "argument --stop-every: needs --stop-for"),
        (["certify", "job.py", "--kill-every", "5s", "--worker-memory", "lots"], "argument --worker-memory: "),
        (["certify", "job.py", "--kill-every", "5s", "--output", "no/such/dir/c.json"], "argument --output: no such"),
    ],
)
def test_a_user_error_is_one_line_and_exit_status_2(capsys, monkeypatch, tmp_path, argv, message) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.py").write_text("")
    monkeypatch.delenv("DLSCALE_DEBUG", raising=False)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dlscale: error: {message}") and err.count("\n") == 1, err
    raised = re.escape(message.rstrip(": "))
    with pytest.raises(Exception, match=raised):  # with its traceback, for a bug report
        cli.main(["--debug", *argv])
    with pytest.raises(Exception, match=raised):
        cli.main([argv[0], "--debug", *argv[1:]])
    monkeypatch.setenv("DLSCALE_DEBUG", "1")
    with pytest.raises(Exception, match=raised):
        cli.main(argv)


def test_help_is_plain_text_and_complete(capsys) -> None:
    assert cli.main([]) == 0  # a bare dlscale prints the help
    bare = capsys.readouterr().out
    assert bare.startswith("usage: dlscale") and all(c in bare for c in ("run", "export", "evaluate", "info"))
    helps = [bare]
    for argv in (["--help"], ["run", "--help"], ["evaluate", "--help"], ["info", "--help"], ["--version"]):
        with pytest.raises(SystemExit) as done:
            cli.main(argv)
        assert done.value.code == 0
        helps.append(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    helps.append(capsys.readouterr().out)
    assert not any("`" in text for text in helps)
    assert "script [-- ARGS ...]" in " ".join(helps[2].split())
    assert helps[5] == f"dlscale {__version__}\n"


def test_export_writes_the_arrays_as_minibatch_files(capsys, tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((130, 5)).astype(np.float32)
    y = np.arange(130) % 3
    np.savez(tmp_path / "data.npz", features=x, target=y)
    code, out = run_cli(
        capsys,
        "export",
        str(tmp_path / "data.npz"),
        str(tmp_path / "batches"),
        "--batch-size",
        "64",
        "--features",
        "features",
        "--labels",
        "target",
    )
    assert code == 0 and "130 examples as 3 minibatch files" in out
    files = sorted((tmp_path / "batches").glob("*.dlb"))  # beside the export's manifest
    back = DataSet.merge([load(str(f)) for f in files])
    assert [load(str(f)).num_examples() for f in files] == [64, 64, 2]
    assert torch.equal(back.features, torch.from_numpy(x)) and torch.equal(back.labels, torch.from_numpy(y))
    assert cli.main(["export", str(tmp_path / "data.npz"), str(tmp_path / "other")]) == 2
    assert "has no array 'x'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.Tensor, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("cli")
    x, y = load_digits()
    x, y = x[:300], y[:300]
    torch.manual_seed(0)
    net = build(digits_cnn, {"channels": 4, "hidden": 16}, "cross_entropy", lambda p: torch.optim.SGD(p, lr=0.1))
    net.fit(DataSet(x, y).batch_by(32), epochs=3)
    net.save(str(tmp / "model.dln"))
    export_minibatches(DataSet(x, y).batch_by(50), str(tmp / "test"), 50)
    return tmp / "model.dln", tmp / "test", x, y


def test_evaluate_matches_a_local_evaluation(capsys, sc, model_and_data) -> None:
    model, data, x, y = model_and_data
    output = model.parent / "eval.json"
    code, out = run_cli(
        capsys,
        "evaluate",
        str(model),
        str(data),
        "--top-n",
        "3",
        "--output",
        str(output),
        "--import",
        "dlscale.demo",
        "--master",
        sc.master,
    )
    assert code == 0 and "Accuracy" in out
    from dlscale.nn import Network

    local = Evaluation(top_n=3)
    local.eval(y, Network.load(str(model)).output(x))
    result = BaseEvaluation.from_json(output.read_text())
    assert result.confusion_matrix().tolist() == local.confusion_matrix().tolist()
    assert result.top_n_accuracy() == pytest.approx(local.top_n_accuracy())
    assert cli.main(["evaluate", str(model), str(data), "--import", "no_such_module"]) == 2
    assert "argument --import: cannot import no_such_module" in capsys.readouterr().err


def test_predict_writes_one_array_per_file(capsys, sc, model_and_data) -> None:
    model, data, x, _ = model_and_data
    out_dir = model.parent / "predictions"
    code, out = run_cli(
        capsys, "predict", str(model), str(data), str(out_dir), "--batch-size", "16", "--master", sc.master
    )
    assert code == 0 and "300 examples in 6 files" in out
    from dlscale.nn import Network

    expected = Network.load(str(model)).output(x).numpy()
    names = [p.rsplit("/", 1)[-1].rsplit(".", 1)[0] for p in list_paths(sc, str(data)).collect()]
    got = np.concatenate([np.load(out_dir / f"{n}.npy", allow_pickle=False) for n in names])
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_info_lists_every_process_and_flags_mismatches_within_80_columns(capsys, sc) -> None:
    code, out = run_cli(capsys, "info", "--master", sc.master)
    assert code == 0
    assert "2 workers" in out and "all 4 processes run the same versions" in out
    assert f"python       {sys.version_info.major}.{sys.version_info.minor}." in out
    assert max(len(line) for line in out.splitlines()) <= 80
    same = {"python": "3.11.7", "torch": "2.13.0", "fsspec": "2025.3.0"}
    workers = {f"tcp://10.0.0.{i}:40{i:03d}": same for i in range(12)}
    versions = {"client": same, "scheduler": same, **workers, "tcp://10.0.0.99:40099": {**same, "torch": None}}
    table, mismatched = cli.version_table(versions)
    lines = table.splitlines()
    assert mismatched == ["torch"] and max(len(line) for line in lines) <= 80
    assert lines[1:3] == ["python       3.11.7", "torch        differs between processes:"]
    assert lines[3].startswith("             2.13.0         client, scheduler, tcp://10.0.0.0:40000,")
    assert lines[-2] == "             not installed  tcp://10.0.0.99:40099"
    assert lines[-1] == "fsspec       2025.3.0"


def test_the_dashboard_gives_way_to_a_free_port_when_8787_is_taken(recwarn) -> None:
    holder = socket.socket()
    with contextlib.suppress(OSError):  # else it is taken already, by another cluster
        holder.bind(("127.0.0.1", 8787))
        holder.listen()
    logged = logging.handlers.BufferingHandler(capacity=100)  # the cluster silences pytest's handlers
    logging.getLogger("dlscale").addHandler(logged)
    try:
        with SparkContext("local[1]") as ctx:
            address = ctx.uiWebUrl
    finally:
        logging.getLogger("dlscale").removeHandler(logged)
        holder.close()
    assert address.startswith("http://127.0.0.1:") and ":8787/" not in address
    notices = [r.getMessage() for r in logged.buffer if "dashboard" in r.getMessage()]
    assert notices == [f"dashboard port 8787 is taken; the dashboard is at {address}"]
    assert not [w for w in recwarn if "already in use" in str(w.message)]


@pytest.mark.slow
def test_the_documented_evaluate_flow_through_the_command(tmp_path) -> None:
    """docs/running.md: the main job saves its network, and dlscale evaluate --import dlscale.demo
    rebuilds it; without the import, one line says what is missing."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DASK_DLSCALE__STORAGE__ROOT": str(tmp_path)}
    installed = Path(sys.executable).parent / "dlscale"  # the console script pip installs beside python
    assert installed.is_file(), f"{installed} is missing: install dlscale (pip install -e .) to run this test"

    def command(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([*argv], env=env, capture_output=True, text=True, timeout=600)

    job = command(sys.executable, "-m", "dlscale.demo", "--epochs", "1")
    assert job.returncode == 0, job.stderr
    archive = "demo/digits/digits-cnn.dln"
    evaluated = command(str(installed), "evaluate", archive, "demo/digits/test", "--import", "dlscale.demo")
    assert evaluated.returncode == 0, evaluated.stderr
    assert "Accuracy" in evaluated.stdout and "Traceback" not in evaluated.stderr
    unknown = command(str(installed), "evaluate", archive, "demo/digits/test")
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    (line,) = [line for line in unknown.stderr.splitlines() if line.startswith("dlscale: error:")]
    assert "dlscale.demo:digits_cnn" in line
