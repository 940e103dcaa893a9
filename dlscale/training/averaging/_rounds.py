"""The control plane of parameter averaging as bookkeeping: the rounds of a session, the minibatches each
trainer fits in each, who takes part in each round's averaging, and when a round is done.

A plan is a list of rounds; a round gives each trainer a *share* of work items (item ``e * n + i`` is
minibatch ``i`` in the fit's epoch ``e``), possibly none. Every live trainer of a round takes part in
its averaging, with the examples it fitted as its weight (0 without a share). An *attempt* of a round's
averaging has a fixed set of members; a round is *committed* when a trainer reports that it holds the
average of one attempt (every member's state in it), and *settled* when every live trainer of the round
holds that average: then, and only then, the round is reported to the driver, its items fitted. A
trainer commits its rounds in order (it reads one commit's reply before it sends the next): a commit
of round ``k`` from a live member of round ``k - 1`` that has not committed it is refused.

A trainer lost before its round is committed takes its share with it: the share goes to a round inserted
after the open one, split among the others, its shares of later rounds are split among the others, and
the open round's averaging starts again without it (a new attempt). If a trainer still completes an
attempt the lost one took part in (the lost one's state is in that average), that attempt commits and
the moved items are taken back from the later rounds: every item is fitted once. A committed round
whose every holder is lost before it settled is open again (nobody alive has its average, so nobody has
gone on from it).

A share once *handed out* (the trainer asked for it: :meth:`Rounds.begin`) no longer changes: the
trainer may be fitting it. A trainer that streams its rounds (fits round ``k + 1`` while round ``k``'s
averaging is in flight) is handed round ``k + 1`` with round ``k`` and round ``k + 2`` as it commits
round ``k``. So a lost trainer's shares of the rounds handed out to anyone go to rounds inserted
after the last of them (one for each, so that a round's items stay in one epoch), never into a
share handed out, and items are taken back only from rounds not yet handed out.

A round handed out as the last of an epoch whose end a checkpoint wants (``snapshot_epochs``) says so
(``"snapshot"``): its trainers keep its average aside for the driver, which writes the checkpoint from
it while they go on.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dlscale.training._errors import SessionAbortedError, SessionClosedError, TrainerLostError, check_first_start

__all__ = ["Round", "Rounds", "plan_rounds", "SessionAbortedError", "SessionClosedError", "TrainerLostError"]


def plan_rounds(
    items: Sequence[int],
    trainers: Sequence[str],
    per_trainer: int,
    per_epoch: int,
    owner: dict[int, str] | None = None,
) -> list[dict[str, list[int]]]:
    """Rounds of ``items`` (in order) for ``trainers``: consecutive items of one epoch, ``per_trainer`` for
    each trainer a round, split in order (``np.array_split``, as even as can be). With ``owner`` (a
    trainer for each minibatch index), each trainer fits the minibatches it owns, ``per_trainer`` a round."""
    rounds: list[dict[str, list[int]]] = []
    by_epoch: dict[int, list[int]] = collections.defaultdict(list)
    for item in items:
        by_epoch[item // per_epoch].append(item)
    for chunk_items in by_epoch.values():  # the epochs in the order their items come
        if owner is not None:
            own: dict[str, list[int]] = {t: [] for t in trainers}
            for item in chunk_items:
                holder = owner.get(item % per_epoch)
                own[holder if holder in own else trainers[(item % per_epoch) % len(trainers)]].append(item)
            count = max((len(v) + per_trainer - 1) // per_trainer for v in own.values())
            for r in range(count):
                rounds.append({t: v[r * per_trainer : (r + 1) * per_trainer] for t, v in own.items()})
            continue
        step = per_trainer * len(trainers)
        for start in range(0, len(chunk_items), step):
            chunk = chunk_items[start : start + step]
            shares = np.array_split(np.array(chunk, dtype=np.int64), min(len(trainers), len(chunk)))
            r = {t: [] for t in trainers}
            for t, s in zip(trainers, shares):
                r[t] = [int(i) for i in s]
            rounds.append(r)
    return rounds


@dataclass
class Round:
    """One round: each trainer's ``shares``, its averaging's attempts (their members) and its state."""

    shares: dict[str, list[int]]
    attempt: int = 0
    members: dict[int, tuple[str, ...]] = field(default_factory=dict)  # attempt -> its members
    committed: int | None = None  # the attempt whose average the round took
    holders: set[str] = field(default_factory=set)  # live trainers that hold the committed average
    report: list[dict[str, Any]] = field(default_factory=list)  # the committed attempt's members' statistics
    moved: dict[str, list[int]] = field(default_factory=dict)  # a lost member's share, moved to later rounds
    handed: set[str] = field(default_factory=set)  # trainers given their share: the shares stay as they are
    settled: bool = False

    def items(self) -> list[int]:
        return [i for share in self.shares.values() for i in share]


class Rounds:
    """The rounds of one session for its trainers ``alive`` (see the module's docstring)."""

    def __init__(self, name: str, plan: list[dict[str, list[int]]], alive: Collection[str]) -> None:
        self.name = name
        self.alive = set(alive)
        self.rounds = [Round({t: list(s) for t, s in shares.items()}) for shares in plan]
        for r in self.rounds:
            r.members[0] = self._members(r)
        self.stop_at: int | None = None  # rounds from this one on are not begun (a segment's end)
        self.reports: list[dict[str, Any]] = []  # settled rounds, for the driver
        self.abandoned: list[int] = []  # items a lost trainer was given, its work on them dropped: for the driver
        self.gone: set[str] = set()  # trainers lost (not retired)
        self.failed: str | None = None
        self.failed_by: str | None = None
        self.joined: set[str] = set()
        self.version = 0
        self.snapshot_epochs: set[int] = set()  # epochs of the fit whose last round's average is kept
        self.per_epoch = 0  # work items an epoch of the fit (item // per_epoch: its epoch)

    # -- what the session is ----------------------------------------------------------------
    def _members(self, r: Round) -> tuple[str, ...]:
        return tuple(sorted(t for t in r.shares if t in self.alive))

    def open_round(self) -> int:
        """The index of the first round not committed (``len(rounds)`` when every one is)."""
        return next((k for k, r in enumerate(self.rounds) if r.committed is None), len(self.rounds))

    def settled(self) -> bool:
        """Whether every round that is to be trained in this session has settled."""
        end = len(self.rounds) if self.stop_at is None else min(self.stop_at, len(self.rounds))
        return all(r.settled for r in self.rounds[:end])

    def frontier(self) -> int:
        """The last round handed out to a trainer (``-1`` before any): rounds after it may still change."""
        return max((k for k, r in enumerate(self.rounds) if r.handed), default=-1)

    def left(self) -> list[int]:
        """The items of the rounds not committed, in order: what a next session trains."""
        return [i for r in self.rounds if r.committed is None for i in r.items()]

    # -- the trainers' calls -------------------------------------------------------------------
    def begin(self, trainer: str, k: int, ahead: int = 0) -> dict[str, Any]:
        """``trainer``'s share of round ``k`` (after it holds round ``k - 1``'s average, or, streaming,
        as it commits round ``k - 2``) and the round's averaging as it stands (:meth:`sync`), or the end;
        with ``ahead``, also its shares of that many rounds after ``k`` (under ``"next"``)."""
        self._check(trainer)
        if k >= len(self.rounds) or (self.stop_at is not None and k >= self.stop_at):
            return {"end": True, "round": k, "items": []}
        r = self.rounds[k]
        r.handed.add(trainer)
        reply = {"end": False, "round": k, "items": list(r.shares.get(trainer, [])), **self.sync(trainer, k)}
        if self._ends_snapshot_epoch(k):
            reply["snapshot"] = True
        if ahead:
            reply["next"] = self.begin(trainer, k + 1, ahead - 1)
        return reply

    def _ends_snapshot_epoch(self, k: int) -> bool:
        """Whether round ``k`` is, as planned now, the last of an epoch in :attr:`snapshot_epochs` (a round
        inserted later for a lost trainer's items may end that epoch instead: the driver then stops)."""
        if not self.snapshot_epochs:
            return False
        epochs = [{i // self.per_epoch for i in r.items()} for r in self.rounds[k : k + 2]]
        last = len(epochs) == 1 or epochs[0] != epochs[1]
        return len(epochs[0]) == 1 and epochs[0] <= self.snapshot_epochs and last

    def sync(self, trainer: str, k: int) -> dict[str, Any]:
        """Round ``k``'s averaging as ``trainer`` is to take part in it now."""
        self._check(trainer)
        r = self.rounds[k]
        return {
            "attempt": r.attempt,
            "members": list(r.members[r.attempt]),
            "committed": r.committed,
            "holders": sorted(r.holders & self.alive),
        }

    def commit(
        self, trainer: str, k: int, attempt: int, report: list[dict[str, Any]], ahead: int = 0
    ) -> dict[str, Any]:
        """``trainer`` holds the average of round ``k``'s ``attempt`` (``report``: what each member fitted).
        Returns ``{"adopt": holders}`` when the round took another attempt's average (the trainer takes
        that from a holder, then commits it), else its shares of the rounds up to ``k + 1 + ahead`` not
        yet handed to it (:meth:`begin`; a trainer streaming its rounds, ``ahead=1``, has round
        ``k + 1``'s already, unless that round was inserted since) and how round ``k + 1``'s averaging
        stands (under ``"current"``)."""
        self._check(trainer)
        if k > 0 and trainer in self.rounds[k - 1].shares and trainer not in self.rounds[k - 1].holders:
            # a live member of round k - 1 that has not committed it: the commits came out of order
            raise RuntimeError(
                f"trainer {trainer} of session {self.name} committed round {k} before round {k - 1}: "
                "a trainer commits its rounds in order, one at a time; the parameter-averaging protocol is broken"
            )
        r = self.rounds[k]
        if r.committed is None:
            r.committed, r.report = attempt, report
            members = r.members[attempt]
            # a lost member's state is in this average: its items were fitted, not to be fitted again
            for t in [t for t in r.moved if t in members]:
                r.shares[t] = r.moved.pop(t)
                self._take_back(k, set(r.shares[t]))
            for t in list(r.moved):  # the others' states are not: their items stay where they went
                if t in r.handed and t in self.gone:  # and are fitted again (one that retired had not begun them)
                    self.abandoned += r.moved[t]
                r.shares.pop(t, None)
            r.moved.clear()
            for t in [t for t in r.shares if t not in members]:
                r.shares.pop(t)  # a member lost from an earlier attempt, its items gone on
        elif r.committed != attempt:
            return {"adopt": sorted(r.holders & self.alive)}
        r.holders.add(trainer)
        self._settle(k)
        first = next(
            (j for j in range(k + 1, k + 1 + ahead) if j >= len(self.rounds) or trainer not in self.rounds[j].handed),
            k + 1 + ahead,
        )
        reply = self.begin(trainer, first, k + 1 + ahead - first)
        if k + 1 < len(self.rounds):
            reply["current"] = self.sync(trainer, k + 1)
        return reply

    def join(self, trainer: str) -> None:
        """A trainer starting; one lost before it started, or started a second time (its task rerun
        elsewhere after its worker was lost), is refused."""
        self._check(trainer)
        check_first_start(self.joined, trainer, self.name)

    def leave(self, trainer: str, k: int) -> str:
        """``trainer``, whose worker retires, leaves before round ``k`` (it holds round ``k - 1``'s average):
        ``"left"``; ``"stay"`` when it is the last live trainer, ``"later"`` while another live trainer
        still needs round ``k - 1``'s average, which it may have to take from this one."""
        self._check(trainer)
        if len(self.alive) <= 1:
            return "stay"
        if k > 0 and not self.rounds[k - 1].settled:
            return "later"
        self._drop(trainer)
        return "left"

    def first_stoppable(self) -> int:
        """The first round that may still be stopped before: after the open round and
        after every round handed out."""
        return max(self.open_round(), self.frontier()) + 1

    def fail(self, who: str, error: str) -> None:
        if self.failed is None:
            self.failed, self.failed_by = f"{who}: {error}", who

    # -- the cluster's events ---------------------------------------------------------------------
    def lose(self, trainer: str) -> bool:
        """``trainer``'s worker was removed; returns whether it was alive."""
        if trainer not in self.alive:
            return False
        self.gone.add(trainer)
        self._drop(trainer)
        return True

    def _drop(self, trainer: str) -> None:
        self.alive.discard(trainer)
        self.version += 1
        k = self.open_round()
        # a committed round that no live trainer holds (its holders lost before it settled) opens again
        if 0 < k and not self.rounds[k - 1].settled and not (self.rounds[k - 1].holders & self.alive):
            k -= 1
            self._reopen(k)
        last = max(k, self.frontier())  # shares up to this round may be being fitted: they stay as handed out
        moved: list[list[int]] = []  # the lost shares of those rounds, a round each (an epoch's items apart)
        for j, r in enumerate(self.rounds[k:], start=k):
            # the trainer's share, and in a round opened again those of trainers lost while it was committed
            lost = []
            for t in [t for t in r.shares if t not in self.alive]:
                share = r.shares.pop(t)
                if share and j <= last:
                    if j == k:  # its state may yet be in the open round's average: then taken back
                        r.moved[t] = share
                    elif t in r.handed and t in self.gone:  # fitted ahead (streaming) or begun, dropped
                        self.abandoned += share
                    lost += share
                elif share:
                    self._spread(r, share)
            if lost:
                moved.append(lost)
            if trainer in r.members.get(r.attempt, ()):
                r.attempt += 1
                r.members[r.attempt] = self._members(r)
        for n, items in enumerate(moved):
            self._insert_after(last + n, items, self.rounds[k])
        for j in range(max(0, k - 1), len(self.rounds)):
            self._settle(j)

    def _reopen(self, k: int) -> None:
        r = self.rounds[k]
        r.committed, r.report, r.holders = None, [], set()
        r.attempt += 1
        r.members[r.attempt] = self._members(r)

    def _insert_after(self, k: int, items: list[int], among: Round) -> None:
        """A round after round ``k`` for ``items``, split among ``among``'s live trainers (or all alive)."""
        survivors = sorted(t for t in among.shares if t in self.alive) or sorted(self.alive)
        if not survivors:
            return
        inserted = Round({t: [] for t in survivors})
        for t, s in zip(survivors, np.array_split(np.array(items, dtype=np.int64), len(survivors))):
            inserted.shares[t] = [int(i) for i in s]
        inserted.members[0] = self._members(inserted)
        self.rounds.insert(k + 1, inserted)

    def _spread(self, r: Round, items: list[int]) -> None:
        survivors = sorted(t for t in r.shares if t in self.alive) or sorted(self.alive)
        if not survivors:  # every trainer lost: the session fails, the items stay unfitted
            return
        for t, s in zip(survivors, np.array_split(np.array(items, dtype=np.int64), len(survivors))):
            r.shares.setdefault(t, []).extend(int(i) for i in s)
        if r.attempt in r.members:
            r.members[r.attempt] = self._members(r)

    def _take_back(self, k: int, items: set[int]) -> None:
        """Remove ``items`` from the rounds after ``k`` (they were moved there from round ``k``, into a
        round not handed out: see :meth:`_drop`); a round left empty goes unless it was handed out."""
        for r in self.rounds[k + 1 :]:
            for t in r.shares:
                r.shares[t] = [i for i in r.shares[t] if i not in items]
        self.rounds[k + 1 :] = [r for r in self.rounds[k + 1 :] if r.items() or r.handed or r.committed is not None]

    def _settle(self, k: int) -> None:
        if k >= len(self.rounds):
            return
        r = self.rounds[k]
        if r.committed is None or r.settled:
            return
        if {t for t in r.shares if t in self.alive} <= r.holders:
            r.settled = True
            self.reports.append({"round": k, "members": r.report})

    def _check(self, trainer: str) -> None:
        if self.failed is not None:
            raise SessionAbortedError(f"session {self.name} stopped: {self.failed}")
        if trainer not in self.alive:
            raise TrainerLostError(f"trainer {trainer} is not a member of session {self.name}")

    def __repr__(self) -> str:
        return f"Rounds({self.name!r}, {[dataclasses.asdict(r) for r in self.rounds]!r})"
