"""Every fenced ``python`` and ``bash`` block of README.md and docs/*.md runs as written, in a scratch
copy of the repository, with ``s3://`` URLs served by a local S3 server (moto's).

A page's blocks run in order in one process: its python blocks in one namespace, a ``__main__``
module (so that what they define travels to the workers by value, as a script's functions do), its
bash blocks with ``bash -e`` in the copy's root, the venv's ``bin`` first on ``PATH``. The copy's
dlscale is the one imported, so relative paths are under the copy's ``storage/data``. ``s3://bucket``
and ``s3://my-bucket`` reach the local server through the environment (``AWS_ENDPOINT_URL`` and the
keys), as s3fs finds a real bucket's endpoint and keys.

A block that cannot run here has a marker on the line just above it, with the reason:
``<!-- docs-test: skip (needs a SLURM queue) -->``. At most a quarter of the examples' blocks may
have one; the blocks of docs/benchmarks.md and its history, each a benchmark run of minutes to hours (some as root
or on a GPU), are all marked and counted apart.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every page with a fit or the main job in it: about two minutes in all

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
BENCHMARK_PAGES = ("docs/benchmarks.md", "docs/benchmarks-history.md")
LANGUAGES = ("python", "bash")
BUCKETS = ("bucket", "my-bucket")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*skip\s*\((?P<reason>.*)\)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<info>[^\s`]*)")
PAGE_TIMEOUT = 300
S3_KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

# Runs a page's blocks in order; argv: the page's path, then a JSON list of [language, line, code].
# Python blocks are compiled as lines of the page, so a traceback names the page and its line.
RUNNER = textwrap.dedent(
    """
    import json, subprocess, sys, time, types

    page, blocks = sys.argv[1], json.loads(sys.argv[2])
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    started = time.monotonic()
    for language, line, code in blocks:
        print(f"--- {page}:{line} ({language}) at {time.monotonic() - started:.1f} s", flush=True)
        if language == "python":
            exec(compile("\\n" * line + code, page, "exec"), main.__dict__)
        elif subprocess.run(["bash", "-e", "-c", code]).returncode:
            sys.exit(f"{page}:{line}: the bash block failed")
    """
)


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    skip: str | None  # the marker's reason; None: the block runs


def blocks(page: str) -> Iterator[Block]:
    """The page's fenced python and bash blocks, each with the reason of the marker above it."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    markers = {i for i, line in enumerate(lines) if "docs-test" in line}
    for i in markers:
        if not MARKER.match(lines[i]):
            raise AssertionError(f"{page}:{i + 1}: a docs-test marker is <!-- docs-test: skip (the reason) -->")
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if opening["info"] in LANGUAGES:
            marker = i - 1 in markers
            markers.discard(i - 1)
            code = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
            reason = MARKER.match(lines[i - 1])["reason"].strip() if marker else None
            yield Block(page, i + 1, opening["info"], code, reason)
        i = end + 1
    if markers:
        raise AssertionError(f"{page}:{min(markers) + 1}: a docs-test marker not just above a python or bash block")


@pytest.fixture
def s3_buckets(s3_endpoint: str) -> dict[str, str]:
    """The environment in which ``s3://bucket`` and ``s3://my-bucket`` are empty buckets of the local
    server."""
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        aws_access_key_id=S3_KEYS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=S3_KEYS["AWS_SECRET_ACCESS_KEY"],
        region_name=S3_KEYS["AWS_DEFAULT_REGION"],
    )
    for bucket in client.list_buckets().get("Buckets", []):
        for listed in client.get_paginator("list_objects_v2").paginate(Bucket=bucket["Name"]):
            for obj in listed.get("Contents", []):
                client.delete_object(Bucket=bucket["Name"], Key=obj["Key"])
        client.delete_bucket(Bucket=bucket["Name"])
    for bucket in BUCKETS:
        client.create_bucket(Bucket=bucket)
    return {"AWS_ENDPOINT_URL": s3_endpoint, **S3_KEYS}


def scratch_copy(destination: Path) -> Path:
    """The repository's files (tracked, and untracked ones git does not ignore) copied to ``destination``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=False,
    )
    if listed.returncode:
        pytest.skip("the docs test copies the files git lists: it needs a git checkout")
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (ROOT / name).is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, destination / name)
    return destination


@pytest.mark.parametrize("page", [page for page in PAGES if any(b.skip is None for b in blocks(page))])
def test_page(page: str, tmp_path: Path, s3_buckets: dict[str, str]) -> None:
    """The page's runnable blocks run, in order, without an error."""
    runnable = [[b.language, b.line, b.code] for b in blocks(page) if b.skip is None]
    copy = scratch_copy(tmp_path / "repo")
    environment = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "DLSCALE_"))},
        **s3_buckets,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(copy),
        "MPLBACKEND": "Agg",
    }
    ran = subprocess.run(
        [sys.executable, "-c", RUNNER, page, json.dumps(runnable)],
        cwd=copy,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=PAGE_TIMEOUT,
        check=False,
    )
    if ran.returncode:
        started = re.findall(r"^--- (\S+:\d+) \(\w+\)", ran.stdout, flags=re.MULTILINE)
        where = f"the block at {started[-1]}" if started else page
        pytest.fail(f"{where} failed:\n{ran.stdout[-10000:]}", pytrace=False)


def test_markers() -> None:
    """Every marker gives its reason, and at most a quarter of the examples' blocks are marked."""
    every = [block for page in PAGES for block in blocks(page)]
    assert len(every) > 40, "the pages' python and bash blocks were not found"
    assert [f"{b.page}:{b.line}" for b in every if b.skip == ""] == [], "markers without a reason"
    examples = [block for block in every if block.page not in BENCHMARK_PAGES]
    marked = [block for block in examples if block.skip is not None]
    assert 4 * len(marked) <= len(examples), (
        f"{len(marked)} of {len(examples)} blocks are marked, more than a quarter: "
        + ", ".join(f"{b.page}:{b.line} ({b.skip})" for b in marked)
    )
