"""What crosses between host and GPU in a gradient-sharing fit on GPU workers, profiled inside the
workers while they train.

Run from the repository root on a machine with a GPU: ``python -m benchmarks.gpu_profile``. For each
compressor (``topk``, ``dl4j``, ``dense``), a ``SharedTrainingMaster`` fit of the MLP 784-2048-2048-10
(5.8M parameters, ``benchmarks._common``) from minibatch files, on ``local[2]`` with
``DLSCALE_DEVICE=cuda`` (both workers on the machine's GPU), after a warm-up fit. Each worker runs
``torch.profiler`` (CUDA activity, which CUPTI records for the whole process, trainer threads
included) for the timed fit; the copies it records are counted by direction. Per minibatch trained:
copies from the GPU to the host and bytes copied, the same from the host to the GPU (the minibatch
itself goes that way: 64 x 785 values), against the dense update's 4 bytes per parameter; and the
fit's samples/s and each phase's share of the trainers' time (profiled, so slower than unprofiled).
Results go to ``benchmarks/results/gpu-profile.json``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import (
    BATCH,
    command_line,
    export_paths,
    header,
    make_data,
    network,
    parse,
    shrink,
    unavailable,
    write_results,
)

RESULTS = Path(__file__).resolve().parent / "results" / "gpu-profile.json"
COMPRESSORS = ("topk", "dl4j", "dense")
COMPRESSOR_HELP = {
    "topk": "SharedTrainingMaster's default: per-tensor top-k selection, values sent",
    "dl4j": "Deeplearning4j's threshold encoding (Strom 2015)",
    "dense": "every element's value at every step, uncompressed",
}
"""A line on each of :data:`COMPRESSORS`, for ``--help``."""
EXAMPLES = 64 * 200  # 200 minibatches a fit
_PROFILER: list[Any] = []  # the worker's running profiler


def start_profiler() -> None:
    """Start recording CUDA activity in this (worker) process."""
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    profiler.start()
    _PROFILER.append(profiler)


def stop_profiler(directory: str, dask_worker: Any) -> dict[str, list[int]]:
    """Stop recording; ``{direction: [copies, bytes]}`` of the copies recorded (the trace is written
    under ``directory``)."""
    profiler = _PROFILER.pop()
    profiler.stop()
    trace = f"{directory}/{dask_worker.name}.json"
    profiler.export_chrome_trace(trace)
    copies: dict[str, list[int]] = {}
    for event in json.loads(Path(trace).read_text())["traceEvents"]:
        if event.get("cat") == "gpu_memcpy":
            direction = event["name"].split()[1]  # "Memcpy DtoH (Device -> Pinned)" and the like
            count = copies.setdefault(direction, [0, 0])
            count[0] += 1
            count[1] += int(event.get("args", {}).get("bytes", 0))
    return copies


def profile(compressor: str, paths: Any, sc: Any, tmp: str) -> dict[str, Any]:
    from benchmarks import gpu_profile  # by name, not as __main__: the workers' copy keeps its profiler
    from dlscale import SharedTrainingMaster, SparkNet

    def master() -> SharedTrainingMaster:
        return SharedTrainingMaster(BATCH, rng_seed=0, collect_training_stats=True, compressor=compressor)

    SparkNet(sc, network(), master()).fit_paths(sc.parallelize(paths.take(8)))  # imports, CUDA context
    net = network()
    spark_net = SparkNet(sc, net, master())
    sc.client.run(gpu_profile.start_profiler)
    try:
        spark_net.fit_paths(paths)
    finally:
        per_worker = sc.client.run(gpu_profile.stop_profiler, tmp)
    stats = spark_net.training_stats
    steps = sum(t.minibatches for t in stats.trainers)
    busy = sum(t.seconds(p) for t in stats.trainers for p in ("fit", "encode", "send", "apply", "wait"))
    seconds = max(t.phases[-1][1] + t.phases[-1][2] for t in stats.trainers) - min(
        t.phases[0][1] for t in stats.trainers
    )
    copies: dict[str, list[int]] = {}
    for found in per_worker.values():
        for direction, (count, size) in found.items():
            total = copies.setdefault(direction, [0, 0])
            total[0] += count
            total[1] += size
    return {
        "compressor": compressor,
        "minibatches": steps,
        "samples_per_s": steps * BATCH / seconds,
        "dense_update_bytes": 4 * net.num_params(),
        "bytes_sent_per_minibatch": sum(t.bytes_sent for t in stats.trainers) / steps,
        "copies_per_minibatch": {d: c / steps for d, (c, _) in copies.items()},
        "copied_bytes_per_minibatch": {d: b / steps for d, (_, b) in copies.items()},
        "phase_shares": {
            p: sum(t.seconds(p) for t in stats.trainers) / busy for p in ("fit", "encode", "send", "apply", "wait")
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__.splitlines()[0], cases=COMPRESSOR_HELP, title="compressors")
    args = parse(parser, argv, RESULTS)
    if not torch.cuda.is_available():
        unavailable("gpu_profile", "a GPU that torch sees", args.smoke)
    if args.smoke:
        shrink(globals(), EXAMPLES=64 * 8)
    os.environ["DLSCALE_DEVICE"] = "cuda"  # the embedded cluster's workers inherit it
    from dlscale import SparkContext

    x, y, _, _ = make_data()
    runs = []
    with tempfile.TemporaryDirectory() as tmp, SparkContext("local[2]", "gpu-profile") as sc:
        paths = export_paths(sc, x[:EXAMPLES], y[:EXAMPLES], f"{tmp}/train")
        for compressor in COMPRESSORS:
            r = profile(compressor, paths, sc, tmp)
            runs.append(r)
            dense = r["dense_update_bytes"]
            print(
                f"{compressor:6s} {r['samples_per_s']:8,.0f} samples/s; per minibatch: "
                + ", ".join(
                    f"{d} {r['copies_per_minibatch'][d]:.1f} copies, {b:,.0f} bytes ({b / dense:.2%} of the update)"
                    for d, b in sorted(r["copied_bytes_per_minibatch"].items())
                ),
                flush=True,
            )
    write_results(
        args.out,
        {
            **header("gpu_profile", gpu=torch.cuda.get_device_name(0)),
            "setup": {"workers": 2, "device": "cuda", "batch": BATCH, "minibatches_per_fit": EXAMPLES // BATCH},
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
