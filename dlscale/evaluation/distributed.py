"""Evaluating a network across the cluster (DL4J's ``doEvaluation``).

Each partition is evaluated on its worker with one of that worker's copies of the network (sent
to each worker once, see :mod:`dlscale.nn.shipping`), in minibatches of ``batch_size`` examples
whatever the data's own minibatch size; the partitions' evaluations are merged in a tree on the
workers, and only the merged ones reach the driver.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any

from dlscale import config
from dlscale.data.dataset import DataSet, MultiDataSet, rebatch
from dlscale.evaluation._base import BaseEvaluation
from dlscale.nn import shipping
from dlscale.nn.partitions import minibatches, worker_copies
from dlscale.runtime.tasks import check_count, match_threads, where

if TYPE_CHECKING:
    from dlscale.facade.rdd import RDD
    from dlscale.nn.network import Network

Loader = Callable[[Any], DataSet | MultiDataSet]


def do_evaluation(
    network: Network,
    data: RDD,
    *evaluations: BaseEvaluation,
    batch_size: int | None = None,
    num_workers: int | None = None,
    loader: Loader | None = None,
    output: int = 0,
) -> list[BaseEvaluation]:
    """Evaluate ``network`` on ``data`` with every one of ``evaluations`` in one pass.

    ``data`` is an RDD of DataSet or MultiDataSet, or of paths (URLs of minibatch files) read by
    ``loader`` (default: ``.dlb`` files). ``batch_size`` is the number of examples per forward
    pass (default ``dlscale.evaluation.batch-size``); ``num_workers`` the number of network copies
    per worker (default: one per worker thread); ``output`` the output (and label array) of a
    multi-output network that the evaluations read. Returns copies of ``evaluations`` with the
    data's batches added; the arguments are left as they are.
    """
    if not evaluations:
        raise ValueError("do_evaluation needs at least one evaluation, e.g. dlscale.evaluation.Evaluation()")
    for i, e in enumerate(evaluations):
        if not isinstance(e, BaseEvaluation):
            raise TypeError(f"evaluation {i} is a {type(e).__name__}, not a dlscale evaluation")
    batch_size = config.get("evaluation.batch-size") if batch_size is None else batch_size
    check_count("batch_size", batch_size)
    if num_workers is not None:
        check_count("num_workers", num_workers)
    check_count("output", output, 0)
    templates = []
    for e in evaluations:
        t = copy.deepcopy(e)
        t.reset()
        templates.append(t)
    if data.getNumPartitions() == 0:
        merged = templates
    else:
        shipped = shipping.ship(data.ctx.client, network, waiting="the evaluation")
        task = partial(_evaluate_partition, shipped.key, templates, batch_size, num_workers, loader, output)
        merged = data.map_partitions_with_future(task, shipped).treeReduce(_merge_lists)
        shipped.release()
    return [copy.deepcopy(e).merge(m) for e, m in zip(evaluations, merged)]


def _evaluate_partition(
    key: str,
    templates: list[BaseEvaluation],
    batch_size: int,
    num_workers: int | None,
    loader: Loader | None,
    output: int,
    index: int,
    blob: bytes,
    elements: Iterable[Any],
) -> list[list[BaseEvaluation]]:
    evaluations = [copy.deepcopy(t) for t in templates]
    try:
        match_threads()
        with shipping.borrow(key, blob, worker_copies(num_workers)) as network:
            for batch in rebatch(minibatches(elements, loader), batch_size):
                outputs, labels, masks = network.evaluate_batch(batch)
                if output >= len(outputs) or output >= len(labels):
                    raise ValueError(
                        f"output={output}, but the network gives {len(outputs)} outputs for {len(labels)} label arrays"
                    )
                for e in evaluations:
                    e.eval(labels[output], outputs[output], masks[output])
    except Exception as e:
        e.add_note(f"while evaluating partition {index} on {where()}")
        raise
    return [evaluations]


def _merge_lists(a: list[BaseEvaluation], b: list[BaseEvaluation]) -> list[BaseEvaluation]:
    return [x.merge(y) for x, y in zip(a, b)]
