"""Who owns a ``checkpoint.remote`` prefix: one run, as one run owns its run directory.

Two runs on one prefix delete each other's uploads (each one's retention counts the other's
checkpoints as its own) and a resume takes whichever is newest. So the prefix holds an owner
record, ``PREFIX/.hpctrain-owner.json``: the run's id (which every checkpoint it writes carries
in its manifest, ``run_id``), and the instance that holds it now (run directory, host, pid,
since, renewed every :data:`RENEW_S`, released at the end). A run that opens the tier is:

* the owner's run restarted: its run directory's checkpoints carry the owner's run id, or it is
  the run directory the owner record names (a restart before the first checkpoint; the run
  directory's lock keeps that to one live run);
* the owner's run continued elsewhere: a new allocation (an empty run directory) that resumes
  from the tier, while no other instance holds it (released, or not renewed for :data:`LEASE_S`);
* anything else is a second run: refused (exit 2) naming the owner, before it writes anything.

The record is written, then read back after :data:`SETTLE_S`: of two runs that started at once,
the one whose record was overwritten is refused. Object stores have no lock; the uploader
therefore reads the record again before every upload and stops uploading (with a warning;
its checkpoints stay in its run directory) once another instance holds it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from hpctrain.core.errors import UserError

if TYPE_CHECKING:
    from hpctrain.core.storage import Store

log = logging.getLogger("hpctrain")

OWNER_KEY = ".hpctrain-owner.json"  # beside the step-N/ folders (listings only take step-N/ keys)
MAX_OWNER_BYTES = 64 << 10  # a record is ~400 bytes: a larger one is not ours, and is never read whole
RENEW_S = 60.0  # the holder rewrites ``renewed`` this often
LEASE_S = 300.0  # not renewed for this long (and not released): its holder is gone (clocks may differ a little)
SETTLE_S = 0.3  # between writing the record and reading it back: another start that read no record writes meanwhile


class TierOwnedError(UserError):
    """checkpoint.remote belongs to another run, or another instance of this run holds it now."""


def new_run_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Owner:
    run_id: str
    run_dir: str
    host: str
    pid: int
    instance: str
    since: str
    renewed: float
    released: bool = False

    def live(self, now: float) -> bool:
        """Is its holder (probably) still running?"""
        return not self.released and now - self.renewed < LEASE_S

    def describe(self, now: float) -> str:
        state = (f"released {_ago(now - self.renewed)}" if self.released else
                 f"last renewed {_ago(now - self.renewed)}")
        return (f"run {_clean(self.run_id)} (run.dir {_clean(self.run_dir)} on host {_clean(self.host)}, pid "
                f"{self.pid}, since {_clean(self.since)}; {state})")


def _clean(text: str) -> str:
    """A value of the record as shown in a one-line message (whoever can write the prefix wrote it)."""
    shown = "".join(c if c.isprintable() else "?" for c in text)
    return shown if len(shown) <= 200 else shown[:197] + "..."


def _ago(seconds: float) -> str:
    return f"{max(0.0, seconds):.0f} s ago"


_FIELDS: dict[str, type | tuple[type, ...]] = {"run_id": str, "run_dir": str, "host": str, "pid": int,
                                                "instance": str, "since": str, "renewed": (int, float),
                                                "released": bool}


_KINDS = {"pid": "a whole number", "renewed": "a number", "released": "true or false"}  # the others: text
_KINDS.update({key: "text" for key, kind in _FIELDS.items() if kind is str})


def read_owner(store: Store) -> Owner | None:
    """The prefix's owner record; None where there is none. A record that is not one (crafted,
    or another tool's file of that name) is refused naming it: nothing is taken over blindly."""
    where = store.where(OWNER_KEY)
    try:
        size = store.size(OWNER_KEY)
    except FileNotFoundError:
        return None
    if size > MAX_OWNER_BYTES:  # asked before a byte is read
        raise _bad(where, f"it holds more than the {MAX_OWNER_BYTES:,} bytes an owner record ever holds")
    try:
        data = json.loads(store.read(OWNER_KEY))
    except FileNotFoundError:
        return None  # deleted meanwhile
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError included
        raise _bad(where, f"it is not valid JSON ({' '.join(str(err).split())[:80]})") from None
    if not isinstance(data, dict):
        raise _bad(where, "it is not a JSON object")
    for key, kind in _FIELDS.items():
        value = data.get(key, False if key == "released" else None)
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise _bad(where, f"{key!r} is {json.dumps(value)[:60]}, not {_KINDS[key]}")
    return Owner(**{key: data.get(key, False) for key in _FIELDS})


def _bad(where: str, why: str) -> TierOwnedError:
    return TierOwnedError(f"checkpoint.remote: {where} is not an hpctrain owner record ({why}); hint: it names who "
                          "owns the prefix, so nothing is written there: give this run its own checkpoint.remote "
                          "prefix, or delete that object once you know no run uses the prefix")


def write_owner(store: Store, owner: Owner) -> None:
    record: dict[str, Any] = {"written_by": "hpctrain", "owner_version": 1, **asdict(owner),
                              "note": "the run that owns this checkpoint.remote prefix (docs/checkpointing.md)"}
    store.write(OWNER_KEY, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode())


def choose_run(owner: Owner | None, *, local_id: str | None, run_dir: str, resuming: bool, url: str,
               now: float) -> str:
    """The run id under which this run may hold the tier, or :class:`TierOwnedError` naming the
    owner. ``local_id``: the run id the run directory's checkpoints carry; ``resuming``: the run
    resumes from the tier (resume=auto, or a URL of it, and the tier holds a committed checkpoint)."""
    if owner is None:
        return local_id or new_run_id()
    same_dir = owner.run_dir == run_dir
    if same_dir and local_id in (None, owner.run_id):
        return owner.run_id  # this run directory's run again (its lock keeps it to one live run)
    hint = f"hint: give this run its own checkpoint.remote prefix (e.g. {url}-2)"
    if owner.live(now) and not same_dir and (local_id == owner.run_id or (local_id is None and resuming)):
        raise TierOwnedError(f"checkpoint.remote={url} is in use by {owner.describe(now)}: two instances of one run "
                             f"would fork it; {hint}, or start this one once that one has ended (it releases the "
                             f"prefix; a killed one after {LEASE_S:.0f} s)")
    if local_id == owner.run_id or (local_id is None and resuming):
        return owner.run_id  # the same run, continued from another run directory (a new allocation)
    why = "whose checkpoints this run did not resume from" if local_id is None else \
        f"while this run's checkpoints carry run id {local_id}"
    raise TierOwnedError(f"checkpoint.remote={url} belongs to {owner.describe(now)}, {why}: this run would delete "
                         f"its checkpoints and resume from them; {hint}; or continue that run (resume=auto in its "
                         f"run.dir, or in an empty one)")


class Claim:
    """This process's hold on a tier: taken once, checked before every upload, renewed in a
    daemon thread, released at the end."""

    def __init__(self, store: Store, run_id: str, run_dir: str) -> None:
        self.store, self.run_id, self.run_dir = store, run_id, run_dir
        self.instance = uuid.uuid4().hex
        self.since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self, released: bool = False) -> Owner:
        return Owner(self.run_id, self.run_dir, socket.gethostname(), os.getpid(), self.instance, self.since,
                     time.time(), released)

    def take(self, previous: Owner | None) -> None:
        """Write the record, read it back after :data:`SETTLE_S`: another start's record there
        means both wrote at once, and this one is refused."""
        now = time.time()
        if previous is not None and previous.live(now) and previous.instance != self.instance:
            log.warning("checkpoint.remote: %s was not released by %s: this run takes it over", self.store.url,
                        previous.describe(now))
        write_owner(self.store, self._record())
        time.sleep(SETTLE_S)
        back = read_owner(self.store)
        if back is None or back.instance != self.instance:
            who = back.describe(time.time()) if back is not None else "a run that deleted the record"
            raise TierOwnedError(f"checkpoint.remote={self.store.url} was claimed at the same moment by {who}; "
                                 f"hint: give each run its own checkpoint.remote prefix")
        self._thread = threading.Thread(target=self._renew_loop, name="hpctrain-ckpt-owner", daemon=True)
        self._thread.start()

    def holds(self) -> bool:
        """Does this instance still hold the tier? (One small read.) The first time it does not,
        a warning names who does; store errors are raised (the upload then fails, said)."""
        owner = read_owner(self.store)
        if owner is not None and owner.instance == self.instance:
            return True
        if not self.lost:
            self.lost = True
            who = owner.describe(time.time()) if owner is not None else "nobody (its owner record was deleted)"
            log.warning("checkpoint.remote: %s is now held by %s: this run uploads no more checkpoints there (its "
                        "checkpoints stay in run.dir %s) and its retention deletes nothing there", self.store.url,
                        who, self.run_dir)
        return False

    def _renew_loop(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                if not self.holds():
                    return
                write_owner(self.store, self._record())
            except Exception as err:  # noqa: BLE001 - a store that does not answer: the uploads say so; retried
                log.debug("checkpoint.remote: renewing the owner record of %s: %s", self.store.url, err)

    def release(self) -> None:
        """At the end: the record says released, so a new allocation elsewhere need not wait the lease."""
        self._stop.set()
        if self._thread is None:
            return
        try:
            if self.holds():
                write_owner(self.store, self._record(released=True))
        except Exception as err:  # noqa: BLE001 - the run has ended well; only a move elsewhere waits the lease
            log.warning("checkpoint.remote: could not mark %s released (%s); a run from another run.dir can "
                        "continue this one %.0f s after this one's last renewal", self.store.url,
                        " ".join(str(err).split()), LEASE_S)
