"""The main job end to end on its own embedded cluster: export, parameter averaging at the frequency
the fit chose, evaluation, save, reload and keyed inference agree with each other."""

from __future__ import annotations

import logging
import logging.handlers

import pytest

from dlscale import demo


def test_main_job(tmp_path, capsys) -> None:
    logged = logging.handlers.BufferingHandler(capacity=10_000)  # the demo's cluster silences pytest's own handlers
    logging.getLogger("dlscale").addHandler(logged)
    try:
        report = demo.main(["--epochs", "8", "--storage", str(tmp_path / "digits")])
    finally:
        logging.getLogger("dlscale").removeHandler(logged)
    assert "Top-3 Accuracy" in capsys.readouterr().out
    lines = [r.getMessage() for r in logged.buffer]
    assert any(line.startswith("parameter averaging: epoch 8/8, ") and ", loss " in line for line in lines)
    closing = [line for line in lines if " minibatches in " in line]  # one for the fit, all its segments
    assert len(closing) == 1 and "averaging every" in closing[0] and "measured" in closing[0], closing
    assert report["accuracy"] > 0.8  # trained (chance is 0.1); accuracy against single-process is test_training's
    assert report["top_3_accuracy"] >= report["accuracy"]
    # keyed inference with the reloaded network predicts what the evaluation counted
    assert report["keyed_outputs"] == demo.TEST_EXAMPLES
    assert report["keyed_accuracy"] == pytest.approx(report["accuracy"], abs=1e-9)
    assert (tmp_path / "digits" / "digits-cnn.dln").exists()
