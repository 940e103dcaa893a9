"""The main job: python -m dlscale.demo trains, evaluates, saves and serves a CNN on a cluster.

On an embedded cluster (or any --master): export the bundled handwritten digits to minibatch files
under demo/digits in the storage root, train a small CNN with parameter averaging from those files
(ParameterAveragingTrainingMaster with its defaults: the fit chooses how often to average, and its
closing line says what it chose, why, and the speedup it predicted and measured), with a checkpoint
every epoch written while the trainers go on, evaluate it on the held-out files (accuracy, top-3
accuracy, F1, one-vs-all AUC), save it with its optimizer state, load it back, and run keyed
inference over the test images, showing progress and printing a final report. The saved network
names its model factory dlscale.demo:digits_cnn, however the job was started, so that
dlscale evaluate ... --import dlscale.demo rebuilds it.
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import torch

import dlscale
from dlscale import (
    CheckpointListener,
    ParameterAveragingTrainingMaster,
    SparkConf,
    SparkContext,
    SparkNet,
    storage,
)
from dlscale.data import DataSet, export_minibatches, list_paths, load_digits
from dlscale.evaluation import Evaluation, ROCMultiClass
from dlscale.nn import Network, build, model_factory

TEST_EXAMPLES = 297


@model_factory
def digits_cnn(channels: int = 16, hidden: int = 64) -> torch.nn.Module:
    """A small CNN for 8x8 grey images and 10 classes."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, channels, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(channels, 2 * channels, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(2 * channels * 16, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def _split(seed: int = 0) -> tuple[torch.Tensor, ...]:
    images, labels = load_digits()
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    test, train = order[:TEST_EXAMPLES], order[TEST_EXAMPLES:]
    return images[train], labels[train], images[test], labels[test]


def _export(x: torch.Tensor, y: torch.Tensor, url: str, batch: int) -> None:
    export_minibatches([DataSet(x[i : i + batch], y[i : i + batch]) for i in range(0, len(x), batch)], url, batch)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dlscale.demo", description=__doc__)
    parser.add_argument(
        "--master",
        default=None,
        help="local[N], local[*] or tcp://host:port (default: local[2], or what dlscale run --master set)",
    )
    parser.add_argument(
        "--storage", default="demo/digits", help="where the job's files go (a relative path is under the storage root)"
    )
    parser.add_argument("--epochs", type=int, default=15, help="training epochs (default 15)")
    parser.add_argument("--batch-size", type=int, default=32, help="minibatch size per worker (default 32)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run from its last checkpoint (one is written every epoch under "
        "STORAGE/checkpoints), with its exported files",
    )
    return parser


def _prepare(base: str, options: dict[str, Any], batch_size: int, resume: Any) -> tuple[torch.Tensor, ...]:
    """The data split, exported afresh under ``base`` unless the run resumes from checkpoint ``resume``."""
    x, y, test_x, test_y = _split()
    print(f"data: {len(x)} training and {len(test_x)} test images of handwritten digits (8x8)")
    if resume is None:
        fs, path = storage.open_fs(base, options)
        if fs.exists(path):
            fs.rm(path, recursive=True)
        _export(x, y, f"{base}/train", batch_size)
        _export(test_x, test_y, f"{base}/test", 64)
        print(f"exported minibatch files to {base}/train and {base}/test")
    else:
        print(f"resuming from {resume.url} (epoch {resume.epoch}, iteration {resume.iteration})")
    return x, y, test_x, test_y


def _saved_and_served(
    sc: SparkContext,
    network: Network,
    base: str,
    options: dict[str, Any] | None,
    test_x: torch.Tensor,
    test_y: torch.Tensor,
) -> tuple[float, dict[str, torch.Tensor]]:
    """Save ``network`` with its optimizer state, load it back and infer on the test images by key:
    the accuracy of the keyed outputs, and the outputs by key."""
    model_url = f"{base}/digits-cnn.dln"
    network.save(model_url, storage_options=options)
    restored = Network.load(model_url, storage_options=options)
    print(f"saved the network with its optimizer state to {model_url} and loaded it back")
    pairs = sc.parallelize([(f"test-{i}", test_x[i].clone()) for i in range(len(test_x))], 4)
    outputs = dict(SparkNet(sc, restored).feed_forward_with_key(pairs).collect())
    predicted = torch.stack([outputs[f"test-{i}"] for i in range(len(test_x))]).argmax(1)
    return int((predicted == test_y).sum()) / len(test_y), outputs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the job, print its report, and return the report's figures."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs and --batch-size must be positive")

    base, options = storage.resolve(args.storage)
    checkpoints = CheckpointListener(f"{base}/checkpoints", save_every_n_epochs=1, keep_last=2, storage_options=options)
    started = time.perf_counter()
    resume = checkpoints.last_checkpoint() if args.resume else None
    if args.resume and resume is None:
        parser.error(f"--resume: there is no checkpoint under {base}/checkpoints to resume from")
    _, _, test_x, test_y = _prepare(base, options, args.batch_size, resume)

    conf = SparkConf().setIfMissing("spark.master", "local[2]")  # `dlscale run --master` sets it
    if args.master is not None:
        conf.setMaster(args.master)
    with SparkContext(conf=conf, appName="dlscale-demo") as sc:
        print(f"cluster: {sc.master}, {sc.defaultParallelism} worker threads, dashboard {sc.uiWebUrl}")
        network = build(digits_cnn, {}, "cross_entropy", functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9))
        print(f"network: CNN with {network.num_params():,} parameters; training with parameter averaging")
        master = ParameterAveragingTrainingMaster(args.batch_size, collect_training_stats=True, rng_seed=0)
        spark_net = SparkNet(sc, network, master)
        spark_net.set_listeners(checkpoints)
        t0 = time.perf_counter()
        spark_net.fit_paths(  # a live bar on a terminal, a line per epoch in a log
            list_paths(sc, f"{base}/train"),
            epochs=args.epochs,
            resume_from=None if resume is None else resume.url,
            storage_options=options,
        )
        train_seconds = time.perf_counter() - t0

        test_paths = list_paths(sc, f"{base}/test")
        evaluation, roc = spark_net.do_evaluation(test_paths, Evaluation(top_n=3), ROCMultiClass())
        print(evaluation.stats())

        keyed_accuracy, outputs = _saved_and_served(sc, network, base, options, test_x, test_y)
        sent = spark_net.training_stats.summary() if spark_net.training_stats is not None else ""
    report = {
        "train_seconds": train_seconds,
        "accuracy": evaluation.accuracy(),
        "top_3_accuracy": evaluation.top_n_accuracy(),
        "f1_macro": evaluation.f1(),
        "auc": roc.calculate_average_auc(),
        "keyed_accuracy": keyed_accuracy,
        "keyed_outputs": len(outputs),
        "seconds": time.perf_counter() - started,
    }
    print(sent)
    print(
        f"report: trained {args.epochs} epochs in {train_seconds:.1f} s; test accuracy {report['accuracy']:.4f}, "
        f"top-3 {report['top_3_accuracy']:.4f}, macro F1 {report['f1_macro']:.4f}, mean one-vs-all AUC "
        f"{report['auc']:.4f}; keyed inference on {len(outputs)} images from the reloaded network: "
        f"accuracy {keyed_accuracy:.4f}; done in {report['seconds']:.1f} s"
    )
    dlscale.report(accuracy=report["accuracy"], f1_macro=report["f1_macro"])  # for dlscale certify
    return report


if __name__ == "__main__":
    # run the module imported under its own name, whose factory is dlscale.demo:digits_cnn (this
    # copy's, run as __main__, would be __main__:digits_cnn, which no other process can import)
    from dlscale import demo

    demo.main()
