"""Rank 0 decides for every rank: the verdicts of the on-line trials agreed across a job.

Each rank of a job runs its own on-line trials (bf16 autocast on/off, the compile ladder's rungs:
:mod:`apt_model.devices.call_timer`), and under DDP a rank's step time includes its wait for the
others in the gradient all-reduce. Near a threshold two ranks of one job could keep different
settings (a probe saw bf16 kept on one rank and turned off on the other in 2 of about 20 two-rank
CPU runs, and the compile ladder's verdicts differ once in 3): the ranks then computed in different
precisions. Since 2026-11-28 rank 0's verdict holds for every rank.

The protocol (no collective: a collective issued from a hook, between the script's own and DDP's,
could hang or pair with the wrong call on another rank):

* The verdict of a trial is published by rank 0 in the default process group's key-value store
  (``torch.distributed``'s store, the one the launcher's rendezvous made), under a key naming the
  switch session, the model (a fingerprint of its class and parameter shapes, and how many models
  of that fingerprint came before it: ranks training *different* models, pipeline stages, never
  match) and the trial.
* Another rank, at its own verdict, reads rank 0's if it is there and follows it. If it is not
  there yet, the rank goes on alternating the two settings (the trial's ABBA order, untimed, as
  rank 0 still does: the ranks stay in step) and looks again at each training call — a
  non-blocking ``check`` of one key. Blocking would hang the job: rank 0 reaches its verdict only
  by training, which waits for this rank's gradients.
* A rank that sees no verdict from rank 0 within :data:`WAIT_CALLS_FACTOR` times the trial's
  length keeps its own (rank 0 trained another model, or its trial never ended), and says so.

Nothing changes for a single process or a world of one; without a store (no default group at the
verdict, a backend without one) each rank keeps its own verdict, as before.
"""
from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import weakref

import torch.nn as nn

from apt_model.base.log import get_logger

log = get_logger(__name__)

_SESSIONS = itertools.count(1)  # switch sessions in this process: the first part of every key

#: A rank waits for rank 0's verdict at most this many times the calls its own trial needed.
WAIT_CALLS_FACTOR = 2

KEY_PREFIX = "apt_vb/verdict"
#: Seconds a rank other than 0 waits, at its verdict, for rank 0 to say it runs the same trial.
START_GRACE_S = 15


def model_fingerprint(model: nn.Module) -> str:
    """A short digest (12 hex digits) of ``model``'s class and its parameters' names, shapes and
    dtypes: equal on every rank of a data-parallel job, different for different models."""
    h = hashlib.sha1(type(model).__qualname__.encode())
    for name, p in model.named_parameters():
        h.update(f"|{name}:{tuple(p.shape)}:{p.dtype}".encode())
    return h.hexdigest()[:12]


def _group():
    """``(world_size, rank, store)`` of the default process group, or ``(1, 0, None)`` when there
    is none (or no store can be had: then each rank decides alone)."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return 1, 0, None
        world = dist.get_world_size()
        if world <= 1:
            return world, dist.get_rank(), None
        return world, dist.get_rank(), dist.distributed_c10d._get_default_store()
    except Exception as err:  # noqa: BLE001 - any failure: each rank decides alone, and says why
        log.info("no process-group store for the ranks' agreement (%s: %s): each rank keeps its own verdicts",
                 type(err).__name__, err)
        return 1, 0, None


class TrialChannel:
    """Where one trial's verdict is agreed between the ranks (see the module docstring).

    Args:
        key: the store key of this trial's verdict (the same on every rank for the same model and trial).

    The :class:`~apt_model.devices.call_timer.CallTimer` calls :meth:`settle` at its local verdict
    and, while that returns None, :meth:`poll` at each training call. Both return ``(keep, summary)``
    — the verdict to apply and the trial's summary with ``ranks`` added (``{"world": N, "rank": r,
    "by": "rank 0" | "own", ...}``) — or None (rank 0 has not decided yet). Never raise: a store
    that fails makes the rank keep its own verdict, with the error in ``ranks["error"]``.
    """

    def __init__(self, key: str):
        self.key = key
        self._local: tuple[bool, dict] | None = None
        self._world = 1
        self._rank = 0
        self._store = None
        self._started = False
        self.waited = 0  # training calls this rank waited for rank 0's verdict

    def start(self) -> None:
        """At the trial's timed calls: rank 0 says it runs this trial (a rank whose rank 0 never
        started it keeps its own verdict after :data:`START_GRACE_S`, instead of waiting for a
        verdict). Done once there is a process group: the switch creates its group at the first
        training forward, after this call's hooks began (before 2026-11-28 only the first timed
        call tried, so under the switch's own DDP rank 0 never said so, and every other rank kept
        its own verdict). Never raises."""
        if self._started:
            return
        world, rank, store = _group()
        if store is None:
            return  # no group yet: the next timed call looks again
        self._started = True
        if rank == 0:
            try:
                store.set(self.key + "/started", "1")
            except Exception as err:  # noqa: BLE001
                log.info("rank 0 could not publish the start of trial %s: %s", self.key, err)

    def _ranked(self, keep: bool, summary: dict, by: str, **extra) -> tuple[bool, dict]:
        """``(keep, summary)`` with the ``ranks`` entry: this rank, the world, whose verdict (``by``)."""
        return keep, {**summary, "ranks": {"world": self._world, "rank": self._rank, "by": by, **extra}}

    def settle(self, keep: bool, summary: dict, final: bool = False) -> tuple[bool, dict] | None:
        """The local verdict ``keep`` is in. ``final``: it stands whatever rank 0 says (a give-up,
        a forward that failed under the setting): published by rank 0, never waited for."""
        world, rank, store = _group()
        self._world, self._rank, self._store = world, rank, store
        if store is None:
            return keep, summary
        if rank == 0:
            try:
                store.set(self.key, json.dumps({"keep": bool(keep), "speedup": summary.get("speedup")}))
            except Exception as err:  # noqa: BLE001
                return self._ranked(keep, summary, "own", error=f"publishing failed: {type(err).__name__}: {err}")
            return self._ranked(keep, summary, "rank 0")
        if final:
            return self._ranked(keep, summary, "own", error="this rank's verdict is final (the trial gave up)")
        try:
            if not self._rank0_started(store):
                return self._ranked(keep, summary, "own", error="rank 0 runs no such trial (another model)")
        except Exception as err:  # noqa: BLE001
            return self._ranked(keep, summary, "own", error=f"{type(err).__name__}: {err}")
        self._local = (keep, summary)
        return self.poll(count=False)

    def _rank0_started(self, store) -> bool:
        """Whether rank 0 said it runs this trial, waiting up to :data:`START_GRACE_S` seconds for
        it: a rank that reached its verdict before rank 0 began the same trial (rank 0 slower, on a
        loaded machine) took it for another model's and kept its own verdict (a rehearsal's
        failure, 2026-11-29). Once per trial, and only on a rank other than 0."""
        started = self.key + "/started"
        if store.check([started]):
            return True
        try:
            store.wait([started], datetime.timedelta(seconds=START_GRACE_S))
        except Exception:  # noqa: BLE001 - the store's timeout: rank 0 runs another model
            return False
        return True

    def poll(self, count: bool = True) -> tuple[bool, dict] | None:
        if self._local is None:
            return None
        keep, summary = self._local
        try:
            if not self._store.check([self.key]):
                self.waited += count
                return None
            theirs = json.loads(self._store.get(self.key).decode())
        except Exception as err:  # noqa: BLE001
            return self._ranked(keep, summary, "own", error=f"{type(err).__name__}: {err}")
        return bool(theirs["keep"]), self._ranked(keep, summary, "rank 0", own_keep=bool(keep),
                                                  rank0_speedup=theirs.get("speedup"), waited_calls=self.waited)[1]

    def give_up(self) -> tuple[bool, dict] | None:
        """The wait is over: this rank's own verdict (None when it was not waiting)."""
        if self._local is None:
            return None
        return self._ranked(*self._local, "own", waited_calls=self.waited,
                            error=f"rank 0 published no verdict within {self.waited} training calls")


class RankAgreement:
    """The switch session's service ``"agreement"``: hands out one :class:`TrialChannel` per trial.

    Keys read ``apt_vb/verdict/<session>/<fingerprint>#<k>/<trial>``: ``<session>`` counts the
    switch sessions of this process (1 for the first ``enable()``), ``<fingerprint>`` is
    :func:`model_fingerprint` (taken when the model's first channel is made), ``<k>`` counts the
    models of that fingerprint before it in the session (not the adoption order: a rank that adopts
    an extra model of its own first, a small evaluation net, still matches the others), ``<trial>``
    names the trial (``mixed_precision``, ``compile/<rung>/<attempt>``).
    """

    def __init__(self):
        self.session = next(_SESSIONS)
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> "<fingerprint>#<k>"
        self._seen: dict[str, int] = {}

    def channel(self, model: nn.Module, trial: str) -> TrialChannel:
        """The channel of ``model``'s trial ``trial``."""
        name = self._names.get(model)
        if name is None:
            fp = model_fingerprint(model)
            k = self._seen.get(fp, 0)
            self._seen[fp] = k + 1
            name = self._names[model] = f"{fp}#{k}"
        return TrialChannel(f"{KEY_PREFIX}/{self.session}/{name}/{trial}")


def agreement_note(keep: bool, summary: dict, timing: str) -> str | None:
    """The reason a follower rank gives for a verdict it took from rank 0, or None when the
    trial's own words hold (a single process, rank 0 itself, a rank whose own verdict stands).

    Args:
        keep: the verdict applied.
        summary: the trial's summary, with ``ranks`` from :class:`TrialChannel`.
        timing: this rank's own timing words (``"bf16 10 ms vs fp32 12 ms ...: 1.20x"``).
    """
    ranks = summary.get("ranks")
    if not ranks or ranks["by"] != "rank 0" or ranks["rank"] == 0:
        return None
    sp = ranks.get("rank0_speedup")
    theirs = f" (rank 0 measured {sp:.2f}x)" if isinstance(sp, (int, float)) else ""
    own = "kept it" if ranks["own_keep"] else "turned it off"
    return (f"{'kept' if keep else 'turned off'} as rank 0 decided for all {ranks['world']} ranks{theirs}; "
            f"this rank's own trial ({timing}) alone would have {own}")


def ranks_suffix(summary: dict) -> str:
    """Words appended to the trial's own reason about the ranks ('' for a single process)."""
    ranks = summary.get("ranks")
    if not ranks:
        return ""
    if ranks["by"] == "rank 0":
        return f"; rank 0 decides for all {ranks['world']} ranks: this verdict is published for the others"
    return f"; rank {ranks['rank']} of {ranks['world']} keeps its own verdict ({ranks.get('error', 'no agreement')})"
