"""A worker imports from several threads at once (its event loop unpickling a message, its task
threads): dlscale's modules imported concurrently, in any interleaving, must all load whole."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CONCURRENT_IMPORTS = textwrap.dedent(
    """
    import importlib, pathlib, random, sys, threading, time
    import bokeh.plotting, dask.bag, distributed, fsspec, numpy, torch, zarr  # others' imports are not under test

    seed, folder = int(sys.argv[1]), pathlib.Path(sys.argv[2])
    parts = [f.relative_to(folder.parent).with_suffix("").parts for f in folder.rglob("*.py")]
    names = sorted({".".join(p[:-1] if p[-1] == "__init__" else p) for p in parts})
    pauses = {name: random.Random(f"{seed}-{name}") for name in names}

    class Interleave:
        # every thread pauses a little, at random, before each of dlscale's modules it finds
        def find_spec(self, name, path=None, target=None):
            if name.startswith("dlscale."):
                time.sleep(pauses[threading.current_thread().name].uniform(0, 0.02))
            return None

    sys.meta_path.insert(0, Interleave())
    errors = []
    def load(name):
        try:
            importlib.import_module(name)
        except Exception as e:
            errors.append(f"{name}: {type(e).__name__}: {e}")
    threads = [threading.Thread(target=load, args=(n,), name=n) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("\\n".join(errors) or "ok")
    """
)


@pytest.mark.parametrize("seed", [0, 1])
def test_modules_imported_by_many_threads_at_once_load_whole(seed: int, tmp_path: Path) -> None:
    """A thread per module and package of dlscale, all started at once, each pausing at random before
    each of dlscale's modules it imports. With packages whose ``__init__`` imported their modules
    (dlscale.data, nn, encoding, evaluation, training.sharing), this failed with "cannot import name ...
    from partially initialized module", as the first tasks of a worker started mid-fit did."""
    (tmp_path / "imports.py").write_text(CONCURRENT_IMPORTS)
    done = subprocess.run(
        [sys.executable, str(tmp_path / "imports.py"), str(seed), str(ROOT / "dlscale")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok", done.stdout


def test_a_registry_finds_its_built_ins_in_a_process_that_imported_only_its_home() -> None:
    """Evaluation types and loaders register themselves as their modules are imported; packages import
    their modules lazily, so a registry imports them before a lookup (a worker reading an evaluation's
    JSON imports only ``dlscale.evaluation._base``)."""
    code = (
        "import dlscale.evaluation._base as e, dlscale.data.loaders as l; "
        "print(e.REGISTRY.lookup('ROC').__name__, l.REGISTRY.lookup('image').__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ROC", "ImageFileBatchLoader"]
