"""Admission: which episode may start, as pure counters (no asyncio, no I/O).

The executor (``rollout/executor.py``) asks ``capacity()`` and reports what happens to each
group of trajectories; everything a resumed run must know about the counts lives here.

Async mode uses AReaL's capacity rule (``areal/core/staleness_manager.py``), which bounds
how stale a trained sample can be::

    capacity = min((in_flight - generating) // width,
                   (max_head_offpolicyness + version + 1) * batch_size - (accepted + running))

The first term counts request slots, not groups: a group's samples end at very different
lengths (boba's longest of 16 is ~2.5x the mean), and a group that held its slots until its
last sample ended kept the servers only ~40 % full (mean / longest; an early run of
``bench/rollout_fleet.py``, confounded by the client's CPU, showed 28 %). So each sample
gives its slot back when it ends, and groups (``running``) may outnumber
``in_flight // width``; the staleness term counts groups.

Sync mode admits only while a batch is waited for (``wanted``), never more groups than that
batch can still use: ``ready + running <= wanted``. Every group then runs with the weights
the batch trains (on-policy), and with dynamic sampling a dropped group is replaced by
exactly one new one, so the batch ends with nothing in flight and the set of groups judged
does not depend on timing.

``accepted`` counts the groups ready or consumed (a property: ``consumed + ready``); it is
restored from a checkpoint as the number consumed, so the staleness bound holds across a
resume (AReaL #1388: a reset counter admitted ``max_head_offpolicyness + version + 1``
batches at once). A group whose admission version is more than ``max_head_offpolicyness``
behind when it would be handed out is dropped (``drop_stale``) and frees its place.

DAPO's dynamic sampling (arXiv 2503.14476) judges each landed group (``judge``): a group it
rejects (all rewards equal) never counts in ``accepted``, so it frees capacity for a fresh
group as a stale one does. One batch judges at most ``max_judged`` groups
(``rollout.dynamic_sampling_max_rounds`` x batch size); then it is handed out short.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class Admission:
    width: int  # request slots a group takes at admission (rollout.n_samples)
    in_flight: int  # request slots in all (rollout.max_concurrent_rollouts x n_samples)
    max_head_offpolicyness: int
    batch_size: int  # groups per batch
    sync: bool  # one batch at a time, admitted while it is waited for
    max_judged: int | None = None  # dynamic sampling: groups judged per batch at most; None: off
    version: int = 0  # the weight version the servers serve
    next_group: int = 0  # the next group's id (seeds and request ids derive from it)
    running: int = 0  # groups admitted and not landed
    generating: int = 0  # request slots they hold
    ready: int = 0  # groups landed, kept and not handed out
    consumed: int = 0  # groups handed out in batches
    wanted: int = 0  # sync: the waited-for batch's size (0: nothing is admitted)
    seen: int = 0  # groups judged since the last batch
    kept: int = 0  # ... and kept
    dropped_stale: int = 0
    dropped_uniform: int = 0  # groups dynamic sampling rejected
    max_generating_seen: int = 0
    slots: dict[int, int] = field(default_factory=dict)  # group -> request slots it holds

    @property
    def accepted(self) -> int:
        """Groups ready or consumed: what the staleness bound counts."""
        return self.ready + self.consumed

    def capacity(self) -> int:
        """How many groups may start now (0 or less: none)."""
        free = (self.in_flight - self.generating) // self.width
        if self.sync:
            room = self.wanted - self.ready - self.running
            if self.max_judged is not None:
                room = min(room, self.max_judged - self.seen - self.running)
            return min(free, room)
        return min(free, (self.max_head_offpolicyness + self.version + 1) * self.batch_size
                   - (self.accepted + self.running))

    def admit(self) -> int:
        """Counts a group started at ``version``; returns its id."""
        gid, self.next_group = self.next_group, self.next_group + 1
        self.running += 1
        self.slots[gid] = self.width
        self.generating += self.width
        self.max_generating_seen = max(self.max_generating_seen, self.generating)
        return gid

    def free(self, gid: int, n: int | None = None) -> None:
        """Gives back ``n`` of the group's request slots (None: all it still holds): a
        sample's at its end, and at the group's end those of samples cancelled before they
        started."""
        held = self.slots.get(gid, 0)
        n = held if n is None else min(n, held)
        if held - n:
            self.slots[gid] = held - n
        else:
            self.slots.pop(gid, None)
        self.generating -= n

    def land(self, gid: int) -> None:
        """The group ended (landed, failed or cancelled): no longer running."""
        self.free(gid)
        self.running -= 1

    def judge(self, keep: bool) -> None:
        """A landed group kept (ready for a batch) or rejected by dynamic sampling."""
        self.seen += 1
        if keep:
            self.kept += 1
            self.ready += 1
        else:
            self.dropped_uniform += 1

    def stale(self, start_version: int) -> bool:
        """Whether a group admitted at ``start_version`` is too old to hand out now."""
        return start_version < self.version - self.max_head_offpolicyness

    def drop_stale(self) -> None:
        self.ready -= 1  # frees capacity for a fresh group
        self.dropped_stale += 1

    def cut(self) -> bool:
        """Dynamic sampling judged as many groups as one batch may look at."""
        return self.max_judged is not None and self.seen >= self.max_judged

    def hand_out(self, n: int) -> None:
        self.ready -= n
        self.consumed += n
        self.seen = self.kept = 0

    def state_dict(self) -> dict:
        return {"version": self.version, "consumed": self.consumed, "next_group": self.next_group,
                "dropped_stale": self.dropped_stale, "dropped_uniform": self.dropped_uniform}

    def load_state_dict(self, state: dict) -> None:
        # Groups in flight or ready at checkpoint time died with the process: only the
        # consumed ones count, and nothing was judged since the last batch.
        self.version = state["version"]
        self.consumed = state["consumed"]
        self.next_group = state["next_group"]
        self.dropped_stale = state["dropped_stale"]
        self.dropped_uniform = state.get("dropped_uniform", 0)  # absent in checkpoints before it
        self.ready = self.seen = self.kept = 0
