"""What taking a round's average late costs local SGD's accuracy: the arithmetic of streaming rounds,
simulated in one process.

Run from the repository root with ``python -m benchmarks.late_average`` (about 6 minutes). W
trainers (replicas in this process, one after the other) fit rounds of H minibatches each from the
digits models of ``benchmarks.quality`` (their data, learning rates, batches, epochs, SGD with momentum
0.9, every epoch's order from the seed); each round's states (parameters, momentum, batch-norm
statistics) are averaged, and each trainer takes the average after ``late`` minibatches of the next
round, keeping what it fitted since it sent its state (``FlatState.settle``'s arithmetic): ``late`` 0
is plain averaging, H a whole round late (one-round-delayed averaging), between them what
``ParameterAveragingTrainingMaster(streaming=True)`` does as the average comes (at most half a round).
Test accuracy is the mean over ``SEEDS``. Results go to ``benchmarks/results/late_average.json``.
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._common import command_line, header, parse, shrink, write_results
from benchmarks.quality import MODELS, Model, load

RESULTS = Path(__file__).resolve().parent / "results" / "late_average.json"
SEEDS = (0, 1, 2)
GRID = {"digits_mlp": ((2, 4), (5, 20)), "digits_cnn": ((2, 4), (5, 20))}  # model: trainers, frequencies
EPOCHS: int | None = None  # None: each model's own
MODEL_HELP = {
    name: f"{MODELS[name].title}: W = {', '.join(map(str, trainers))}; H = {', '.join(map(str, frequencies))}"
    for name, (trainers, frequencies) in GRID.items()
}
"""A line on each model of :data:`GRID`, for ``--help``."""


def _lates(frequency: int) -> list[int]:
    return sorted({0, 1, frequency // 2, frequency})


class _Replica:
    """A trainer: its module, its optimizer, and its state as one vector (parameters, momentum, buffers)."""

    def __init__(self, model: Model, seed: int) -> None:
        self.module = model.module(seed)
        self.optimizer = model.optimizer(self.module.parameters())

    def _tensors(self) -> list[torch.Tensor]:
        params = list(self.module.parameters())
        for p in params:  # momentum buffers from the start, so that every state has the same layout
            if "momentum_buffer" not in self.optimizer.state[p]:
                self.optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
        momentum = [self.optimizer.state[p]["momentum_buffer"] for p in params]
        return params + momentum + [b for b in self.module.buffers() if b.is_floating_point()]

    def state(self) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in self._tensors()])

    def set_state(self, v: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for t in self._tensors():
                t.copy_(v[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.module.train()
        self.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(self.module(x), y).backward()
        self.optimizer.step()


def simulate(model: Model, trainers: int, frequency: int, late: int, seed: int) -> float:
    """Test accuracy after local SGD of ``trainers`` every ``frequency`` minibatches, each taking a round's
    average ``late`` minibatches into the next round (0: plain averaging)."""
    torch.manual_seed(seed)
    x, y, tx, ty = load(model, False)
    b = model.batch
    n = len(x) // b
    epochs = EPOCHS or model.epochs
    order = [int(i) for e in range(epochs) for i in np.random.default_rng([seed, e]).permutation(n)]
    replicas = [_Replica(model, seed) for _ in range(trainers)]
    start = replicas[0].state()
    for r in replicas:
        r.set_state(start)
    pending: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # the last round's average and sent states
    per_round = trainers * frequency
    for at in range(0, len(order), per_round):
        chunk = order[at : at + per_round]
        for t, replica in enumerate(replicas):
            share = chunk[t * frequency : (t + 1) * frequency]
            for j in range(len(share) + 1):
                if pending is not None and j == min(late, len(share)):
                    average, sent = pending
                    replica.set_state(average + (replica.state() - sent[t]))
                if j < len(share):
                    i = share[j]
                    replica.step(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b])
        sent = [r.state() for r in replicas]
        pending = (torch.stack(sent).mean(0), sent)
        if late == 0:
            for r in replicas:
                r.set_state(pending[0])
            pending = None
    if pending is not None:
        replicas[0].set_state(pending[0])
    module = replicas[0].module.eval()
    with torch.no_grad():
        return float((module(tx).argmax(1) == ty).float().mean())


def _setup(model: Model) -> dict[str, Any]:
    return {"title": model.title, "lr": model.lr, "batch": model.batch, "epochs": EPOCHS or model.epochs}


def main(argv: list[str] | None = None) -> None:
    title = "models (W trainers, rounds of H minibatches, each average taken 0, 1, H/2 and H minibatches late)"
    args = parse(command_line(__doc__.splitlines()[0], cases=MODEL_HELP, title=title), argv, RESULTS)
    if args.smoke:
        shrink(globals(), SEEDS=(0,), GRID={"digits_mlp": ((2,), (5,))}, EPOCHS=1)
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    for name, (trainer_counts, frequencies) in GRID.items():
        model = MODELS[name]
        for trainers, frequency in itertools.product(trainer_counts, frequencies):
            plain = None
            for late in _lates(frequency):
                accuracies = [simulate(model, trainers, frequency, late, s) for s in SEEDS]
                mean = statistics.fmean(accuracies)
                plain = mean if late == 0 else plain
                rows.append(
                    {
                        "model": name,
                        "trainers": trainers,
                        "frequency": frequency,
                        "late": late,
                        "accuracies": accuracies,
                        "accuracy": mean,
                        "vs_plain_points": 100 * (mean - plain),
                    }
                )
                print(
                    f"{name:11s} {trainers} trainers every {frequency:2d}, average taken {late:2d} late: "
                    f"accuracy {mean:.4f} ({100 * (mean - plain):+.1f} points)",
                    flush=True,
                )
    write_results(
        args.out,
        {
            **header("late_average"),
            "setup": {
                "seeds": list(SEEDS),
                "models": {n: _setup(MODELS[n]) for n in GRID},
                "optimizer": "SGD momentum 0.9",
            },
            "runs": rows,
        },
    )


if __name__ == "__main__":
    main()
