"""Gradient sharing's two departures from DL4J, measured: momentum masking and the adaptive
threshold's small-message bound.

Run from the repository root with ``python -m benchmarks.momentum_masking`` (about 3 minutes).
On ``SparkContext("local[2]")``, scikit-learn's digits (1,200 training and 597 test images) train
two SGD models with gradient sharing under four settings, six seeds each, against a
single-process run of the same model, epochs and minibatches of 16:

- **small**: an MLP 64-32-10 (2,410 parameters), lr 0.05, momentum 0.9, 10 epochs, one trainer per
  worker, where DL4J's 1% sparsity bound allows 24 elements a message;
- **slow**: an MLP 64-64-10 (4,810 parameters), lr 0.01, momentum 0.9, 3 epochs, two trainers per
  worker: a model whose early progress comes from momentum.

Settings: DL4J's (no masking, ``small_message_elements=0``), each departure alone, and both
(dlscale's defaults). Recorded per run: test accuracy, each trainer's last threshold. The cost of
masking is timed on the 5.8M-parameter MLP of ``benchmarks.compare`` with a 1% message, against a
dense decode of the same message. Results go to ``benchmarks/results/momentum_masking.json``.
"""

from __future__ import annotations

import functools
import itertools
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import accuracy, command_line, digits, header, mlp, parse, shrink, write_results
from dlscale import SharedTrainingMaster, SparkContext, SparkNet
from dlscale.data import DataSet
from dlscale.encoding import AdaptiveThresholdAlgorithm, Dl4jCompressor, Layout, decode, encode
from dlscale.nn import Network
from dlscale.training.sharing._keeping import mask_momentum

RESULTS = Path(__file__).resolve().parent / "results" / "momentum_masking.json"
BATCH = 16
SEEDS = (0, 1, 2, 3, 4, 5)
MODELS = {
    "small": {"sizes": [64, 32, 10], "lr": 0.05, "epochs": 10, "trainers_per_worker": 1},
    "slow": {"sizes": [64, 64, 10], "lr": 0.01, "epochs": 3, "trainers_per_worker": 2},
}
MASKING_REPEATS = 50
SETTINGS = {  # name: (momentum_masking, small_message_elements)
    "dl4j": (False, 0),
    "small_messages": (False, 512),
    "masking": (True, 0),
    "dlscale": (True, 512),
}
SETTING_HELP = {
    "dl4j": "DL4J's: no momentum masking, small_message_elements=0",
    "small_messages": "the adaptive threshold's small-message bound alone (small_message_elements=512)",
    "masking": "momentum masking alone",
    "dlscale": "both, dlscale's defaults: momentum masking and small_message_elements=512",
}
"""A line on each of :data:`SETTINGS`, for ``--help``."""


def _network(sizes: list[int], lr: float) -> Network:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return Network(
        torch.nn.Sequential(*layers[:-1]), "cross_entropy", functools.partial(torch.optim.SGD, lr=lr, momentum=0.9)
    )


def single_process(model: dict[str, Any], data: tuple[torch.Tensor, ...]) -> float:
    x, y, tx, ty = data
    net = _network(model["sizes"], model["lr"])
    g = torch.Generator().manual_seed(1)
    for _ in range(model["epochs"]):
        order = torch.randperm(len(x), generator=g)
        net.fit([DataSet(x[order[i : i + BATCH]], y[order[i : i + BATCH]]) for i in range(0, len(x), BATCH)])
    return accuracy(net.module, tx, ty)


def shared(
    sc: SparkContext, model: dict[str, Any], setting: tuple[bool, int], seed: int, data: tuple[torch.Tensor, ...]
) -> dict[str, Any]:
    x, y, tx, ty = data
    masking, small = setting
    net = _network(model["sizes"], model["lr"])
    master = SharedTrainingMaster(
        BATCH,
        rng_seed=seed,
        collect_training_stats=True,
        momentum_masking=masking,
        workers_per_node=model["trainers_per_worker"],
        compressor="dl4j",
        aggregation="sum",
        threshold_algorithm=AdaptiveThresholdAlgorithm(small_message_elements=small),
    )
    spark_net = SparkNet(sc, net, master)
    rdd = sc.parallelize([DataSet(x[i : i + 4], y[i : i + 4]) for i in range(0, len(x), 4)], 4)
    spark_net.fit(rdd, epochs=model["epochs"])
    return {
        "seed": seed,
        "accuracy": accuracy(net.module, tx, ty),
        "last_thresholds": [t.steps[-1][1] for t in spark_net.training_stats.trainers if t.steps],
    }


def masking_cost(repeats: int = 50) -> dict[str, float]:
    """Milliseconds to mask the momentum of a 1% message on the 5.8M MLP, and to decode it densely."""
    torch.set_num_threads(1)
    net = Network(mlp(), "cross_entropy", functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9))
    net.fit_batch(DataSet(torch.randn(64, 784), torch.randint(0, 10, (64,))))  # makes the momentum buffers
    residual = torch.randn(net.num_params(), generator=torch.Generator().manual_seed(0))
    message = encode(residual, 2.576)  # |N(0, 1)| >= 2.576 for 1% of the elements
    out = {"parameters": net.num_params(), "sparsity": message.sparsity}
    dl4j = Dl4jCompressor()
    state = dl4j.state(Layout.of(net.module.parameters()))
    steps = (
        ("mask_ms", lambda: mask_momentum(net, dl4j.momentum_mask(state, message))),  # positions, then mask
        ("dense_decode_ms", lambda: decode(message)),
    )
    for name, step in steps:
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        out[name] = (time.perf_counter() - start) / repeats * 1000
    return out


def main(argv: list[str] | None = None) -> None:
    title = f"settings (models: {', '.join(MODELS)}; each against a single process)"
    args = parse(command_line(__doc__.splitlines()[0], cases=SETTING_HELP, title=title), argv, RESULTS)
    if args.smoke:
        shrink(
            globals(),
            SEEDS=(0,),
            MODELS={name: {**model, "epochs": 1} for name, model in MODELS.items()},
            MASKING_REPEATS=2,
        )
    data = digits()
    report: dict[str, Any] = {
        **header("momentum_masking"),
        "setup": {
            "batch": BATCH,
            "seeds": list(SEEDS),
            "models": MODELS,
            "settings": {k: {"momentum_masking": m, "small_message_elements": s} for k, (m, s) in SETTINGS.items()},
        },
        "models": {},
    }
    with SparkContext("local[2]", "momentum-masking") as sc:
        for name, model in MODELS.items():
            single = single_process(model, data)
            entry: dict[str, Any] = {"single_process_accuracy": single, "settings": {}}
            for setting, values in SETTINGS.items():
                runs = [shared(sc, model, values, seed, data) for seed in SEEDS]
                accuracies = [r["accuracy"] for r in runs]
                entry["settings"][setting] = {
                    "runs": runs,
                    "mean_accuracy": sum(accuracies) / len(accuracies),
                    "points_below_single": 100 * (single - sum(accuracies) / len(accuracies)),
                }
                print(
                    f"{name:5s} {setting:14s} accuracy {min(accuracies):.3f}-{max(accuracies):.3f} "
                    f"(single process {single:.3f}); last thresholds "
                    f"{min(t for r in runs for t in r['last_thresholds']):.3g}-"
                    f"{max(t for r in runs for t in r['last_thresholds']):.3g}",
                    flush=True,
                )
            report["models"][name] = entry
    report["cost"] = masking_cost(MASKING_REPEATS)
    cost = report["cost"]
    print(
        f"masking a {cost['sparsity']:.1%} message on {cost['parameters']:,} parameters: {cost['mask_ms']:.2f} ms "
        f"({cost['mask_ms'] / cost['dense_decode_ms']:.2f}x a dense decode, {cost['dense_decode_ms']:.2f} ms)"
    )
    write_results(args.out, report, indent=1)


if __name__ == "__main__":
    main()
