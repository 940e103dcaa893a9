"""Accumulators (PySpark's ``pyspark.accumulators``): variables that tasks only add to and the driver reads.

A task works on its own copy, which starts at the accumulator's zero: each computation of a partition
(a call of :func:`collecting` around the user's functions) gathers its additions in one record,
identified by the partition's graph key and a fresh run id. The records travel with the partition
they were made for, and are carried along by every task that reads it, into the results an action
brings back to the driver; nothing is sent per addition. The driver then adds each record once
(:meth:`Accumulators.deliver`):

- a partition computed twice within one action (its task retried after its worker died, or its lost
  output recomputed) comes with two records under one key: only one is added;
- a record read again by a later action (a persisted partition carries its records) is not added again;
- a partition recomputed by a later action (not persisted) makes a new record, which is added: as in
  Spark, updates made in transformations count again when a later action computes them again.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from dlscale.errors import AccumulatorAccessError

T = TypeVar("T")

__all__ = [
    "COMPLEX_ACCUMULATOR_PARAM",
    "FLOAT_ACCUMULATOR_PARAM",
    "INT_ACCUMULATOR_PARAM",
    "Accumulator",
    "AccumulatorParam",
    "AddingAccumulatorParam",
]

# (graph key of the partition, run id) -> {accumulator id: the additions of that run}
Updates = dict[tuple[Any, bytes], dict[int, Any]]


class AccumulatorParam(Generic[T]):
    """How to add values of an accumulator's type: ``zero(value)`` gives the zero of ``value``'s shape,
    ``addInPlace(value1, value2)`` their sum (updating ``value1`` in place and returning it may save a copy)."""

    def zero(self, value: T) -> T:
        raise NotImplementedError

    def addInPlace(self, value1: T, value2: T) -> T:
        raise NotImplementedError


class AddingAccumulatorParam(AccumulatorParam[T]):
    """An ``AccumulatorParam`` that adds with ``+=`` from a fixed zero."""

    def __init__(self, zero_value: T) -> None:
        self.zero_value = zero_value

    def zero(self, value: T) -> T:
        return self.zero_value

    def addInPlace(self, value1: T, value2: T) -> T:
        value1 += value2  # type: ignore[operator]
        return value1


INT_ACCUMULATOR_PARAM = AddingAccumulatorParam(0)
FLOAT_ACCUMULATOR_PARAM = AddingAccumulatorParam(0.0)
COMPLEX_ACCUMULATOR_PARAM = AddingAccumulatorParam(0.0j)

_local = threading.local()  # .records: the records being gathered by this thread's partition computations


class Accumulator(Generic[T]):
    """A variable that tasks add to (``acc += x``, ``acc.add(x)``) and only the driver reads (``acc.value``).

    Made by :meth:`SparkContext.accumulator`. In a task, ``value`` is an error (as in Spark): a task sees only
    its own additions, which reach the driver with the task's result.
    """

    def __init__(self, aid: int, value: T, accum_param: AccumulatorParam[T]) -> None:
        self.aid = aid
        self.accum_param = accum_param
        self._value = value
        self._deserialized = False
        self._zero: Any = None

    def __reduce__(self) -> tuple:
        return (_deserialize_accumulator, (self.aid, self.accum_param.zero(self._value), self.accum_param))

    @property
    def value(self) -> T:
        """The accumulated value; on the driver only."""
        if self._deserialized:
            raise AccumulatorAccessError("Value `Accumulator.value` cannot be accessed inside tasks.")
        return self._value

    @value.setter
    def value(self, value: T) -> None:
        if self._deserialized:
            raise AccumulatorAccessError("Value `Accumulator.value` cannot be accessed inside tasks.")
        self._value = value

    def add(self, term: T) -> None:
        """Add ``term``: on the driver to the value, in a task to the task's own additions."""
        if not self._deserialized:
            self._value = self.accum_param.addInPlace(self._value, term)
            return
        records = getattr(_local, "records", None)
        if records is None:
            raise AccumulatorAccessError(
                f"accumulator {self.aid} was added to in a task that runs no RDD operation: only the functions "
                "given to RDD operations can add to accumulators"
            )
        current = records[self.aid] if self.aid in records else copy.deepcopy(self._zero)
        records[self.aid] = self.accum_param.addInPlace(current, term)

    def __iadd__(self, term: T) -> Accumulator[T]:
        self.add(term)
        return self

    def __str__(self) -> str:
        return str(self._value)

    def __repr__(self) -> str:
        return f"Accumulator<id={self.aid}, value={self._value}>"


def _deserialize_accumulator(aid: int, zero: Any, accum_param: AccumulatorParam) -> Accumulator:
    """An accumulator's copy in a task: adds to the records of the partition being computed."""
    acc = Accumulator(aid, zero, accum_param)
    acc._deserialized = True
    acc._zero = zero
    return acc


@contextlib.contextmanager
def collecting(key: Any) -> Iterator[Updates]:
    """Gather the additions made in this thread meanwhile as the record of the partition ``key``; yields the
    records to attach to the result (the record, when there were additions, and nothing else)."""
    outer = getattr(_local, "records", None)
    records: dict[int, Any] = {}
    _local.records = records
    found: Updates = {}
    try:
        yield found
    finally:
        _local.records = outer
    if records:
        run = os.urandom(8)
        found[(run if key is None else key, run)] = records


class Accumulators:
    """The driver's accumulators of one context, and the records it has added."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._accumulators: weakref.WeakValueDictionary[int, Accumulator] = weakref.WeakValueDictionary()
        self._delivered: set[bytes] = set()  # run ids of the records added so far
        self._lock = threading.Lock()

    def new(self, value: T, accum_param: AccumulatorParam[T]) -> Accumulator[T]:
        acc = Accumulator(next(self._ids), value, accum_param)
        self._accumulators[acc.aid] = acc
        return acc

    def deliver(self, updates: Updates, action: set | None = None) -> None:
        """Add the records an action brought back: one record per partition, none that was added before.
        ``action`` holds the partitions already added by the same action (``take``'s rounds of jobs share
        one); by default the records are an action of their own."""
        keys = set() if action is None else action
        with self._lock:
            for (key, run), additions in updates.items():
                if run in self._delivered:
                    continue
                self._delivered.add(run)
                if key in keys:
                    continue  # the same partition computed again within this action
                keys.add(key)
                for aid, term in additions.items():
                    acc = self._accumulators.get(aid)
                    if acc is not None:
                        acc._value = acc.accum_param.addInPlace(acc._value, term)
