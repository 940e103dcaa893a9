"""The per-process network cache of dlscale.nn.shipping: copies lent to one task at a time, up to a
number per network; networks forgotten beyond dlscale.inference.cached-networks, least recently used
first, except those a fit has pinned; take and give back from many threads at once."""

from __future__ import annotations

import pickle
import threading
import time

import dask
import torch

from dlscale.nn import Network, shipping
from dlscale.nn.shipping import NetworkCache


def blob(seed: int = 0) -> bytes:
    torch.manual_seed(seed)
    return shipping.serialise(Network(torch.nn.Linear(3, 2), "mse"))


def test_a_borrowed_copy_is_given_back_and_lent_again() -> None:
    cache, data = NetworkCache(), blob()
    with cache.borrow("a", data, 2) as first:
        assert isinstance(first, Network)
    with cache.borrow("a", data, 2) as again:
        assert again is first
    assert cache.copies_made() == {"a": 1}


def test_copies_per_key_are_made_while_all_are_in_use_up_to_the_limit() -> None:
    cache, data = NetworkCache(), blob()
    with cache.borrow("a", data, 2) as one, cache.borrow("a", data, 2) as two:
        assert one is not two
        assert torch.equal(one.params(), two.params())
    with cache.borrow("b", blob(1), 1) as other:
        assert not torch.equal(other.params(), one.params())
    assert cache.copies_made() == {"a": 2, "b": 1}

    third = threading.Event()

    def wait_for_a_copy() -> None:
        with cache.borrow("a", data, 2):
            third.set()

    with cache.borrow("a", data, 2), cache.borrow("a", data, 2):
        waiting = threading.Thread(target=wait_for_a_copy)
        waiting.start()
        assert not third.wait(0.2)  # both copies are lent: the third task waits
    waiting.join(5)
    assert third.is_set() and cache.copies_made() == {"a": 2, "b": 1}


def test_the_lru_bound_forgets_unpinned_networks_only() -> None:
    cache, data = NetworkCache(), blob()
    with dask.config.set({"dlscale.inference.cached-networks": 2}):
        fit_network, _ = cache.pin("fit", data)
        for key in ("a", "b", "c"):
            with cache.borrow(key, data, 1):
                pass
        assert cache.copies_made() == {"fit": 1, "b": 1, "c": 1}  # "a", least recently used, is gone
        with cache.borrow("b", data, 1):
            pass
        with cache.borrow("d", data, 1):
            pass
        assert cache.copies_made() == {"fit": 1, "b": 1, "d": 1}
        assert cache.pin("fit", data)[0] is fit_network  # never evicted, never unpickled again
        cache.drop("fit")
        assert cache.copies_made() == {"b": 1, "d": 1}


def test_a_network_evicted_while_lent_is_given_back_harmlessly() -> None:
    cache, data = NetworkCache(), blob()
    with dask.config.set({"dlscale.inference.cached-networks": 1}):
        with cache.borrow("a", data, 1) as lent:
            with cache.borrow("b", data, 1):
                assert cache.copies_made() == {"b": 1}
        with cache.borrow("a", data, 1) as fresh:
            assert fresh is not lent
        assert cache.copies_made() == {"a": 1}


def test_a_pinned_network_is_one_copy_used_by_one_task_at_a_time() -> None:
    cache, data = NetworkCache(), blob()
    network, lock = cache.pin("fit/0", data, 0, 2)
    again, same_lock = cache.pin("fit/0", data, 0, 2)
    assert again is network and same_lock is lock
    assert cache.pin("fit/1", data, 1, 2)[0] is not network  # each trainer slot has its own
    with lock:
        assert not lock.acquire(timeout=0.1)  # a second task waits until the first is done
    assert lock.acquire(timeout=1)
    lock.release()
    assert cache.copies_made() == {"fit/0": 1, "fit/1": 1}


def test_take_and_give_back_from_many_threads() -> None:
    cache, data = NetworkCache(), blob()
    in_use: set[int] = set()
    guard = threading.Lock()
    clashes, done = [], []

    def task() -> None:
        for _ in range(40):
            with cache.borrow("a", data, 3) as network:
                with guard:
                    if id(network) in in_use:
                        clashes.append(network)
                    in_use.add(id(network))
                time.sleep(0.0005)
                with guard:
                    in_use.discard(id(network))
        done.append(True)

    threads = [threading.Thread(target=task) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(done) == 8 and clashes == []
    assert cache.copies_made() == {"a": 3}


def test_a_copy_that_fails_to_unpickle_does_not_hold_its_place() -> None:
    cache, errors = NetworkCache(), []

    def attempt() -> None:
        try:
            with cache.borrow("broken", blob()[:20], 1):
                pass
        except Exception as e:
            errors.append(e)

    for _ in range(2):  # the second attempt fails the same way rather than waiting for a copy never made
        t = threading.Thread(target=attempt)
        t.start()
        t.join(5)
        assert not t.is_alive()
    assert [type(e) for e in errors] == [pickle.UnpicklingError] * 2
    assert cache.copies_made() == {"broken": 0}


def test_the_process_cache_serves_training_and_evaluation() -> None:
    data = blob()
    network, lock = shipping.pin("test-shipping-fit", data)
    with shipping.borrow("test-shipping-eval", data, 1) as lent:
        assert lent is not network
    made = shipping.copies_made()
    assert made["test-shipping-fit"] == 1 and made["test-shipping-eval"] == 1
    shipping.drop("test-shipping-fit")
    shipping.drop("test-shipping-eval")
    assert not {"test-shipping-fit", "test-shipping-eval"} & set(shipping.copies_made())
