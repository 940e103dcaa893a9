"""Projected throughput of gradient sharing beyond one machine, from what the 2-worker benchmark measured.

``benchmarks.compare`` projects its measured two-worker gradient-sharing run of the MLP (loopback) to
4 to 256 workers on links of 1, 10 and 100 Gbit/s, and stores the projection in its results and
``docs/images/scaling.png``. ``python -m benchmarks.scaling [--latency S] [--fanout F]`` projects
that same run again with other parameters and prints the table.

Four schemes are compared: dlscale gradient sharing in ``"plain"`` mode (every node sends its update
to every peer) and in ``"mesh"`` mode (updates flood a tree of fanout F, each node passing them on
to its tree neighbours but the one they came from), and a dense ring all-reduce as PyTorch DDP does
it, without (``"ring"``) and with (``"ring_overlapped"``) overlap of communication and compute.

The model (every assumption is spelled out in :data:`ASSUMPTIONS`, which goes into the results):

- each worker runs one trainer on its own machine, with a full-duplex NIC of the link's rate each
  way and a non-blocking fabric; every scheme computes the same measured per-step work;
- gradient sharing is asynchronous: a step takes max(CPU, network) at the busiest node, where CPU is
  fit + encode + hand-off + applying the W-1 updates received + a fixed cost per message copy sent,
  and network is max(bytes out, bytes in) / rate plus one round trip;
- per-node message copies come from flooding one update from every node through dlscale's own
  routing, so a mesh's interior nodes, which relay every update to up to F neighbours, are exact;
- messages keep their measured size whatever W (the adaptive threshold holds each trainer's
  sparsity in its target band);
- the ring all-reduce is synchronous: compute + 2(W-1)/W x dense bytes / rate + 2(W-1) latencies, or
  the max of compute and communication when overlapped.

The model shows what limits each scheme, not what a cluster would measure: samples/s says nothing
of how many samples asynchronous training needs to reach an accuracy.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dlscale.training.sharing import _mesh

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "benchmarks" / "results" / "compare.json"
WORKERS = (4, 8, 16, 32, 64, 128, 256)
LINKS_GBIT = (1, 10, 100)
MODES = ("plain", "mesh", "ring", "ring_overlapped")
MODE_HELP = {
    "plain": "gradient sharing, every node sending its update to every peer",
    "mesh": "gradient sharing over a tree of fanout F (--fanout), each node relaying to its neighbours",
    "ring": "a dense ring all-reduce as PyTorch DDP does it: compute, then communication",
    "ring_overlapped": "the ring with communication overlapping compute (DDP's best case)",
}
"""A line on each of :data:`MODES`, for ``--help``."""

ASSUMPTIONS = [
    (
        "Each worker runs one trainer on its own machine with a full-duplex NIC of the given rate in each direction, "
        "on a non-blocking fabric: no switch contention and no other traffic."
    ),
    (
        "Every scheme does the same per-step compute: the measured fit time of one trainer of the 2-worker run. It "
        "includes moving the optimizer's update into the residual (a few passes over the parameters that DDP does not "
        "make) and was measured with two workers sharing two cores, so a machine of its own would be faster."
    ),
    (
        "Messages keep their measured size whatever W: the default adaptive threshold holds each trainer's sparsity "
        "inside its target band (0.01-1%) and a trainer's own update does not depend on W. Pessimistic for bytes, "
        "since a large cluster would lower the target sparsity; optimistic for training, since samples/s ignores "
        "statistical efficiency: with more asynchronous trainers each update is computed on parameters missing more "
        "in-flight updates (more so over a mesh's hops), so an accuracy may take more samples than with synchronous "
        "all-reduce."
    ),
    (
        "Gradient sharing is asynchronous and overlaps compute with communication: a step takes max(CPU, network) of "
        "the busiest node, which sets the pace of all (in steady state every node must take in, and in a mesh pass on, "
        "every update, and the send buffer holds back a trainer that outruns its links)."
    ),
    (
        "CPU per step = fit + encode (applying its own message included) + hand-off to the node + applying each of the "
        "W-1 updates received + copy_s per message copy the node sends to a peer (its own update's fan-out and, in a "
        "mesh, relaying), charged to the step although Dask's event loop is another thread. Applying one update costs "
        "the measured apply seconds per step of the 2-worker run, where a trainer receives one update per step "
        "(decoding and checking included, under the same contention as fit); it is proportional to the message's "
        "elements, which stay constant."
    ),
    (
        "Network per step = max(bytes out, bytes in) of the node / rate + 2 x latency: coalescing puts a step's "
        "messages for one peer in one call, a link has one call in flight and waits for its reply, and links to "
        "different peers overlap."
    ),
    (
        "Message copies per node come from flooding one update from every node through dlscale's own routing "
        "(dlscale.training.sharing._mesh): in plain mode W-1 out and W-1 in; in a mesh every node takes in W-1 and a "
        "node with d tree neighbours sends (W-1)(d-1)+d, so an interior node sends about F times a plain node's bytes. "
        "A mesh bounds the peers a node talks to (F+1), not its bytes."
    ),
    (
        "Ring all-reduce (PyTorch DDP) is synchronous: step = compute + 2(W-1)/W x dense update bytes / rate + "
        "2(W-1) x latency, one latency per phase of the ring. DDP overlaps gradient buckets with backward, so "
        "'ring_overlapped' = max(compute, communication) is its best case."
    ),
    (
        "Not modelled: per-connection costs (a plain node holds W-1 connections), stragglers, failures, the "
        "scheduler's per-minibatch requests, and start-up and the final gathering of states."
    ),
]


def measured_from(run: dict[str, Any]) -> dict[str, float]:
    """The model's inputs from one gradient-sharing run as ``benchmarks.compare`` records it
    (``samples_per_s``, ``steps``, ``bytes_sent_per_step``, ``dense_update_bytes``,
    ``trainer_seconds``, ``batch``, ``workers``)."""
    workers, steps, phases = run["workers"], run["steps"], run["trainer_seconds"]
    if workers < 2:
        raise ValueError(f"the model needs a run with at least 2 workers, got {workers}")
    return {
        "workers": workers,
        "batch": run["batch"],
        "samples_per_s": run["samples_per_s"],
        "fit_s": phases["fit"] / steps,
        "encode_s": phases["encode"] / steps,
        "send_s": phases["send"] / steps,
        # per trainer step a trainer receives one update from each of its workers - 1 peers
        "apply_per_message_s": phases["apply"] / steps / (workers - 1),
        "message_bytes": run["bytes_sent_per_step"],
        "dense_update_bytes": run["dense_update_bytes"],
    }


def copies(workers: int, mode: str, fanout: int) -> list[tuple[int, int, int]]:
    """Per node, ``(copies sent, copies received, peers)`` in one step in which every node makes one
    update, found by flooding each update along dlscale's own routing."""
    nodes = [f"{i:06d}" for i in range(workers)]  # sorted as the mesh sorts addresses
    sent, received = dict.fromkeys(nodes, 0), dict.fromkeys(nodes, 0)
    for origin in nodes:
        hops: list[tuple[str, str | None]] = [(origin, None)]
        while hops:
            me, came_from = hops.pop()
            for peer in _mesh.targets(nodes, me, mode, fanout, came_from):
                sent[me] += 1
                received[peer] += 1
                hops.append((peer, me))
    return [(sent[n], received[n], len(_mesh.neighbours(nodes, n, mode, fanout))) for n in nodes]


def project(
    measured: dict[str, float],
    workers: Sequence[int] = WORKERS,
    links_gbit: Sequence[float] = LINKS_GBIT,
    latency_s: float = 50e-6,
    fanout: int = 8,
    copy_s: float = 20e-6,
) -> dict[str, Any]:
    """Projected step time, samples/s and bottleneck of every mode on every link for every number of
    workers, from :func:`measured_from`'s inputs (see :data:`ASSUMPTIONS`)."""
    m = measured
    single = m["batch"] / m["fit_s"]
    own = m["fit_s"] + m["encode_s"] + m["send_s"]
    rows = []

    def row(mode: str, gbit: float, w: int, cpu: float, net: float, step: float, out: float, peers: int) -> None:
        rows.append(
            {
                "mode": mode,
                "link_gbit": gbit,
                "workers": w,
                "step_s": step,
                "samples_per_s": w * m["batch"] / step,
                "speedup": w * m["batch"] / step / single,
                "bottleneck": "network" if net > cpu else "compute",
                "bytes_out_per_step": out,
                "peers": peers,
            }
        )

    for w in workers:
        nodes = {mode: copies(w, mode, fanout) for mode in ("plain", "mesh")}
        for gbit in links_gbit:
            rate = gbit * 1e9 / 8
            for mode, per_node in nodes.items():
                cost = []
                for sent, received, peers in per_node:
                    cpu = own + received * m["apply_per_message_s"] + sent * copy_s
                    net = max(sent, received) * m["message_bytes"] / rate + 2 * latency_s
                    cost.append((max(cpu, net), cpu, net, sent * m["message_bytes"], peers))
                step, cpu, net, out, peers = max(cost)
                row(mode, gbit, w, cpu, net, step, out, peers)
            out = 2 * (w - 1) / w * m["dense_update_bytes"]
            comm = out / rate + 2 * (w - 1) * latency_s
            row("ring", gbit, w, m["fit_s"], comm, m["fit_s"] + comm, out, 2)
            row("ring_overlapped", gbit, w, m["fit_s"], comm, max(m["fit_s"], comm), out, 2)
    return {
        "measured": dict(m),
        "parameters": {"latency_s": latency_s, "fanout": fanout, "copy_s": copy_s},
        "single_worker_samples_per_s": single,
        "assumptions": list(ASSUMPTIONS),
        "rows": rows,
    }


def plot(projection: dict[str, Any], path: str | Path) -> None:
    """One PNG, a panel per link rate: samples/s against workers for every mode, and the ideal
    (workers x one worker's compute-only rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = projection["rows"]
    links = sorted({r["link_gbit"] for r in rows})
    workers = sorted({r["workers"] for r in rows})
    fig, axes = plt.subplots(1, len(links), figsize=(5 * len(links), 4.5), sharey=True, squeeze=False)
    for ax, gbit in zip(axes[0], links):
        for mode in MODES:
            mine = sorted(
                (r["workers"], r["samples_per_s"]) for r in rows if (r["mode"], r["link_gbit"]) == (mode, gbit)
            )
            ax.plot(*zip(*mine), marker="o", label=mode.replace("_", " "))
        ax.plot(workers, [w * projection["single_worker_samples_per_s"] for w in workers], "k--", label="ideal")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{gbit:g} Gbit/s")
        ax.set_xlabel("workers")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("samples/s (projected)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(projection: dict[str, Any]) -> str:
    """samples/s per link, workers and mode, with the bottleneck (c compute, n network)."""
    cells = {(r["link_gbit"], r["workers"], r["mode"]): r for r in projection["rows"]}
    lines = ["link     workers" + "".join(f"{mode.replace('_', ' '):>18}" for mode in MODES)]
    for gbit, w in sorted({k[:2] for k in cells}):
        values = "".join(
            f"{cells[gbit, w, mode]['samples_per_s']:>16,.0f} {cells[gbit, w, mode]['bottleneck'][0]}" for mode in MODES
        )
        lines.append(f"{gbit:>3g} Gb/s {w:>7}{values}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Project the MLP's two-worker loopback gradient-sharing run of ``compare.json`` again; print the
    table (and write the projection to ``--out``, if given)."""
    from benchmarks._common import command_line, header, parse, write_results

    parser = command_line(main.__doc__, cases=MODE_HELP, title="modes")
    parser.add_argument("--latency", type=float, default=50e-6, help="seconds per message (default 50e-6)")
    parser.add_argument("--fanout", type=int, default=8, help="mesh fanout (default 8)")
    args = parse(parser, argv, None)
    results = json.loads(SOURCE.read_text())
    run = next(
        r
        for r in results["runs"]
        if (r["workload"], r["runner"], r["workers"], r["link"]) == ("mlp", "sharing", 2, "loopback")
        and "error" not in r
    )
    projection = project(measured_from(run), latency_s=args.latency, fanout=args.fanout)
    print(f"one worker, compute only: {projection['single_worker_samples_per_s']:,.0f} samples/s")
    print(table(projection))
    if args.out is not None:
        write_results(args.out, {**header("scaling"), "source": SOURCE.name, "projection": projection})


if __name__ == "__main__":
    main()
