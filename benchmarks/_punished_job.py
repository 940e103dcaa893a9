"""A training job to certify under faults: ``dlscale certify benchmarks/_punished_job.py --workers 3
--kill-every 5s -- MASTER EPOCHS``.

One fit of scikit-learn's digits (1,500 training and 297 test images, flattened) on an MLP 64-128-10
(SGD, lr 0.05, momentum 0.9, minibatches of 16), for ``EPOCHS`` epochs with ``MASTER``: ``averaging``
(``ParameterAveragingTrainingMaster``, every 5 minibatches) or ``sharing`` (``SharedTrainingMaster``,
its defaults); then its test accuracy, reported with ``dlscale.report``. The script is a plain
dlscale program: its ``SparkContext`` takes the cluster ``dlscale run`` or ``dlscale certify`` gives
it, or starts an embedded one. ``benchmarks.faults --kill-every`` runs it under ``dlscale certify``.
"""

from __future__ import annotations

import functools
import sys

import torch

import dlscale
from dlscale import ParameterAveragingTrainingMaster, SharedTrainingMaster, SparkContext, SparkNet
from dlscale.data import DataSet, load_digits
from dlscale.nn import Network

BATCH = 16


def main(master: str, epochs: int) -> None:
    x, y = load_digits()
    x = x.flatten(1)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    network = Network(module, "cross_entropy", functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9))
    if master == "averaging":
        training = ParameterAveragingTrainingMaster(BATCH, averaging_frequency=5, rng_seed=1)
    elif master == "sharing":
        training = SharedTrainingMaster(BATCH, rng_seed=1)
    else:
        raise SystemExit(f"MASTER must be averaging or sharing, got {master!r}")
    with SparkContext(appName="punished job") as sc:
        rdd = sc.parallelize(DataSet(x[:1500], y[:1500]).batch_by(BATCH), sc.defaultParallelism).cache()
        SparkNet(sc, network, training).fit(rdd, epochs=epochs)
    accuracy = float((network.output(x[1500:]).argmax(1) == y[1500:]).double().mean())
    print(f"test accuracy {accuracy:.4f}")
    dlscale.report(accuracy=accuracy)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
