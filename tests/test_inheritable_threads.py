"""Local properties across threads (``InheritableThread``, ``inheritable_thread_target``), the same program
on dlscale and on PySpark (its default pinned-thread mode): a plain thread starts with none, an
``InheritableThread`` takes a copy of its starter's when started, a wrapped target a copy of those its
wrapper's caller had when wrapping; what a thread then sets stays its own, and its jobs' tasks see its
properties."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pyspark
import pytest

import dlscale

pytestmark = [
    pytest.mark.pyspark,
    # PySpark's, for a target wrapped without a session: its session tags are not inherited
    pytest.mark.filterwarnings("ignore:Spark session is not provided"),
]


def in_thread(make: Callable[[Callable[[], None]], threading.Thread], body: Callable[[], None]) -> None:
    t = make(body)
    t.start()
    t.join()


def clear(c: Any, keys: str) -> None:
    for key in keys:
        c.setLocalProperty(key, None)
    c.clearJobTags()


def nested(c: Any, api: Any) -> list:
    """Spark's own test of it (test_pin_thread's test_inheritable_local_property), and a plain thread."""
    seen: list = []
    c.setLocalProperty("a", "hi")

    def inner() -> None:
        seen.append(("inner", c.getLocalProperty("a"), c.getLocalProperty("b")))

    def outer() -> None:
        seen.append(("outer", c.getLocalProperty("a"), c.getLocalProperty("b")))
        c.setLocalProperty("b", "hello")
        in_thread(lambda f: api.InheritableThread(target=f), inner)

    in_thread(lambda f: api.InheritableThread(target=f), outer)
    seen.append(("main", c.getLocalProperty("a"), c.getLocalProperty("b")))
    in_thread(lambda f: threading.Thread(target=f), lambda: seen.append(("plain", c.getLocalProperty("a"))))
    clear(c, "ab")
    return seen


def copied_when(c: Any, api: Any) -> list:
    """When the copy is taken: at ``start()``, or when the target is wrapped (the same copy for every call
    of the wrapper); job group, description and tags go with the properties."""
    seen: list = []
    c.setLocalProperty("p", "1")
    c.setJobGroup("group", "a description")
    c.addJobTag("tag")

    def target(name: str) -> None:
        seen.append((name, c.getLocalProperty("p"), c.getLocalProperty("q"), sorted(c.getJobTags())))
        seen.append((name, c.getLocalProperty("spark.jobGroup.id"), c.getLocalProperty("spark.job.description")))
        c.setLocalProperty("q", name)

    wrapped = api.inheritable_thread_target(target)
    thread = api.InheritableThread(target=target, args=("started",))
    c.setLocalProperty("p", "2")
    thread.start()
    thread.join()
    for name in ("first", "second"):
        t = threading.Thread(target=wrapped, args=(name,))
        t.start()
        t.join()
    seen.append(("main", c.getLocalProperty("p"), c.getLocalProperty("q")))
    clear(c, ["p", "q", "spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel"])
    return seen


def in_tasks(c: Any, api: Any, task_context: Any) -> list:
    """A job started in the inheriting thread: its tasks read the inherited properties."""
    seen: list = []
    c.setLocalProperty("job.key", "from the parent")

    def job() -> None:
        rdd = c.parallelize(range(2), 2).map(lambda _: task_context.get().getLocalProperty("job.key"))
        seen.append(rdd.collect())

    in_thread(lambda f: api.InheritableThread(target=f), job)
    in_thread(lambda f: threading.Thread(target=api.inheritable_thread_target(f)), job)
    in_thread(lambda f: threading.Thread(target=f), job)
    clear(c, ["job.key"])
    return seen


@pytest.mark.parametrize("program", [nested, copied_when])
def test_properties_across_threads_as_pyspark(sc: Any, spark: Any, program: Any) -> None:
    expected = program(spark, pyspark)
    assert program(sc, dlscale) == expected


def test_tasks_of_an_inheriting_thread_as_pyspark(sc: Any, spark: Any) -> None:
    expected = in_tasks(spark, pyspark, pyspark.TaskContext)
    assert in_tasks(sc, dlscale, dlscale.TaskContext) == expected == [["from the parent"] * 2] * 2 + [[None] * 2]


def test_nested_gives_spark_s_answer(sc: Any) -> None:
    seen = nested(sc, dlscale)
    assert seen == [("outer", "hi", None), ("inner", "hi", "hello"), ("main", "hi", None), ("plain", None)]


def test_no_running_context_gives_plain_threads() -> None:
    seen: list = []
    with pytest.MonkeyPatch.context() as m:
        m.setattr(dlscale.SparkContext, "_running", [])
        wrapped = dlscale.inheritable_thread_target(lambda: seen.append("wrapped"))
        t = dlscale.InheritableThread(target=lambda: seen.append("thread"))
        t.start()
        t.join()
    in_thread(lambda f: threading.Thread(target=f), wrapped)
    assert seen == ["thread", "wrapped"]


def test_every_running_context_s_properties(sc: Any) -> None:
    """dlscale may run several contexts in a process (PySpark, one): a thread's properties on each are copied."""
    seen: list = []
    with dlscale.SparkContext("local[1]", "another") as other:
        sc.setLocalProperty("k", "on sc")
        other.setLocalProperty("k", "on other")

        def target() -> None:
            seen.append((sc.getLocalProperty("k"), other.getLocalProperty("k")))
            other.setLocalProperty("k", "changed")

        in_thread(lambda f: dlscale.InheritableThread(target=f), target)
        in_thread(lambda f: threading.Thread(target=dlscale.inheritable_thread_target(f)), target)
        seen.append((sc.getLocalProperty("k"), other.getLocalProperty("k")))
        sc.setLocalProperty("k", None)
    assert seen == [("on sc", "on other")] * 3


class Session:
    """A stand-in for PySpark's session: tags of its own, by thread as PySpark's are."""

    def __init__(self) -> None:
        self._local = threading.local()

    def getTags(self) -> set[str]:  # noqa: N802 - PySpark's names
        return set(getattr(self._local, "tags", set()))

    def addTag(self, tag: str) -> None:  # noqa: N802
        self._local.tags = self.getTags() | {tag}


def test_a_session_s_tags_are_copied(sc: Any) -> None:
    session = Session()
    session.addTag("s")
    sc.setLocalProperty("k", "v")
    seen: list = []

    def target() -> None:
        seen.append((sorted(session.getTags()), sc.getLocalProperty("k")))

    in_thread(lambda f: dlscale.InheritableThread(target=f, session=session), target)
    decorate = dlscale.inheritable_thread_target(session)
    in_thread(lambda f: threading.Thread(target=decorate(f)), target)
    in_thread(lambda f: threading.Thread(target=f), target)
    sc.setLocalProperty("k", None)
    assert seen == [(["s"], "v"), (["s"], "v"), ([], None)]
