"""The ``dlscale`` command: each subcommand on real clusters and files, and usage errors that name
the flag at fault."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from dlscale import cli
from dlscale.data import DataSet, export_minibatches, list_paths, load, load_digits
from dlscale.demo import digits_cnn
from dlscale.evaluation import BaseEvaluation, Evaluation
from dlscale.nn import build


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

        if __name__ == "__main__":
            with SparkContext() as sc:
                workers = sc.client.scheduler_info(n_workers=-1)["workers"].values()
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
    with pytest.raises(SystemExit, match="no such file"):
        cli.main(["run", str(tmp_path / "missing.py")])


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
    with pytest.raises(SystemExit, match="has no array 'x'"):
        cli.main(["export", str(tmp_path / "data.npz"), str(tmp_path / "other")])


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
    with pytest.raises(SystemExit, match="argument --import: cannot import no_such_module"):
        cli.main(["evaluate", str(model), str(data), "--import", "no_such_module"])


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


def test_info_lists_every_process_and_flags_mismatches(capsys, sc) -> None:
    code, out = run_cli(capsys, "info", "--master", sc.master)
    assert code == 0
    assert "scheduler" in out and out.count("tcp://") >= 2 and "all processes run the same versions" in out
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in out
    same = {"python": "3.11.7", "torch": "2.13.0"}
    table, mismatched = cli.version_table(
        {"client": same, "scheduler": same, "tcp://a:1": same, "tcp://b:2": {**same, "torch": "2.4.0"}}
    )
    assert mismatched == ["torch"]
    assert "<-- differs" in table.splitlines()[2] and "2.4.0" in table
