"""The docs' figures are the results files': every generated block of docs/ is what
``python -m benchmarks.report`` makes of ``benchmarks/results/``, no results file is a byte copy of
another, and every file that records its run ran on a commit of this history from a clean tree."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks._common import git

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
RECORDED_SINCE = "2026-12-02"
"""From this date every results file records its provenance (``provenance``: commit, clean tree, command)."""


def test_every_generated_block_is_what_the_results_give() -> None:
    stale = report.check()
    assert not stale, f"run python -m benchmarks.report: {stale}"


def test_the_pages_have_their_blocks() -> None:
    found = {m["name"] for page in report.PAGES for m in report.BLOCK.finditer((report.DOCS / page).read_text())}
    assert found == set(report.BLOCKS), f"blocks written nowhere or unknown: {found ^ set(report.BLOCKS)}"


def test_a_block_differing_from_its_results_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = tmp_path / "page.md"
    page.write_text("before\n<!-- report:index -->\n| a figure typed by hand |\n<!-- /report:index -->\nafter\n")
    monkeypatch.setattr(report, "DOCS", tmp_path)
    assert report.check(["page.md"]) == ["docs/page.md: index"]
    page.write_text(report.render(page.read_text(), "page.md"))
    assert report.check(["page.md"]) == []
    assert page.read_text().startswith("before\n<!-- report:index -->\n| benchmark |")


def test_an_unknown_block_is_an_error() -> None:
    with pytest.raises(KeyError, match="no generated block 'nothing'"):
        report.render("<!-- report:nothing -->\n<!-- /report:nothing -->", "page.md")


def test_no_results_file_is_a_copy_of_another() -> None:
    seen: dict[str, str] = {}
    for path in sorted(RESULTS.glob("*.json")):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert digest not in seen, f"{path.name} is a byte copy of {seen[digest]}"
        seen[digest] = path.name


def test_recorded_runs_name_a_commit_of_this_history_and_a_clean_tree() -> None:
    if (git("rev-parse", "--is-shallow-repository") or "").strip() != "false":
        pytest.skip("a shallow clone holds too little history to find the results' commits")
    for path in sorted(RESULTS.glob("*.json")):
        result = json.loads(path.read_text())
        run = result.get("provenance")
        if run is None:
            assert report.date_of(result) < RECORDED_SINCE, (
                f"{path.name}: written since {RECORDED_SINCE} without its provenance"
            )
            continue
        assert run["clean"] is True, f"{path.name}: run from a tree with changes ({run.get('changes')})"
        assert git("merge-base", "--is-ancestor", run["commit"], "HEAD") is not None, (
            f"{path.name}: its commit {run['commit']} is not in this history"
        )
        assert run["command"].startswith("python -m benchmarks."), path.name
        assert run["started"] <= run["ended"], path.name


def test_a_file_name_names_a_commit_only_when_it_is_one_of_this_history() -> None:
    head = (git("rev-parse", "HEAD") or "").strip()
    legacy = {"benchmark": "compare", "date": "2026-11-30T00:00:00+00:00"}
    assert report.commit_of(Path(f"compare-mlp-{head[:7]}.json"), legacy) == (head, False)
    assert report.commit_of(Path(f"compare-mlp-{head[:7]}-b.json"), legacy) == (head, False)
    assert report.commit_of(Path("compare-mlp-0000000.json"), legacy) is None
    assert report.commit_of(Path("compare-mlp-streaming.json"), legacy) is None
    dirty = {**legacy, "provenance": {"commit": head, "clean": False}}
    assert report.commit_of(Path("x.json"), dirty) is None
    assert report.commit_of(Path("x.json"), {**legacy, "provenance": {"commit": head, "clean": True}}) == (head, True)


def test_a_run_names_its_commit_and_is_refused_results_from_a_dirty_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import _common

    run = _common.provenance()
    assert run["commit"] == (git("rev-parse", "HEAD") or "").strip()
    assert run["clean"] == (run.get("changes") is None)
    dirty = {**run, "clean": False, "changes": ["dlscale/nn/network.py"]}
    monkeypatch.setattr(_common, "provenance", lambda: dirty)
    results = _common.RESULTS / "never-written.json"
    with pytest.raises(SystemExit):
        _common.parse(_common.command_line("x"), [], results)
    assert "uncommitted changes (dlscale/nn/network.py)" in capsys.readouterr().err
    args = _common.parse(_common.command_line("x"), ["--allow-dirty"], results)
    assert args.out == results
    elsewhere = tmp_path / "elsewhere.json"
    args = _common.parse(_common.command_line("x"), ["--out", str(elsewhere)], results)
    head = _common.header("x")
    assert head["provenance"]["clean"] is False and head["provenance"]["changes"] == ["dlscale/nn/network.py"]
    _common.write_results(elsewhere, head)
    written = json.loads(elsewhere.read_text())["provenance"]
    assert written["started"] <= written["ended"] and written["clean"] is False
    redone = {**json.loads(elsewhere.read_text()), "note": "a report redone from the recorded results"}
    redone["provenance"]["ended"] = "2000-01-01T00:00:00+00:00"
    _common.write_results(elsewhere, redone, ran=False)
    assert json.loads(elsewhere.read_text())["provenance"]["ended"] == "2000-01-01T00:00:00+00:00"
    with pytest.raises(ValueError, match="needs the run's provenance"):
        _common.write_results(results, {"benchmark": "x"})
    assert not results.exists()
