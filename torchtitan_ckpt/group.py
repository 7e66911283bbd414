"""The process group that checkpoint collectives run on, and the few collectives they need."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from .errors import CheckpointError, CollectiveError, RankFailed, few

logger = logging.getLogger(__name__)

T = TypeVar("T")

COLLECTIVE_TIMEOUT_S = 600.0
"""Timeout of every collective on a checkpoint group, by default (`checkpoint.collective_timeout_s`)."""

_WARN_AFTER = 0.25
"""The share of the collective timeout after which a rank waiting in a checkpoint collective
warns of the ranks that have not entered it."""


_MADE_ALIKE = ("makes its CheckpointManager, with checkpoint.enable = true (a disabled one makes no group). "
               "Across nodes, gloo connects the ranks at the address each host's name resolves to (127.0.1.1 on "
               "some hosts, which other nodes cannot reach) or on GLOO_SOCKET_IFNAME: set that to the network "
               "interface the nodes reach each other on")
"""What every rank does alike in making the group (`_failing`): a training job's NCCL finds its
network itself, and gloo may not."""


_GIVEN: dict[dist.ProcessGroup, str] = {}
"""Process groups given to a `CheckpointGroup` of a `user` (a manager, which runs collectives in
the background) not closed yet -> that user: a group given carries one manager at a time. The
groups the package makes over a manager's group for one call are not counted, nor are the
groups of the whole job given, over which a manager makes its own (`CheckpointGroup`)."""


_BROKEN: dict[dist.ProcessGroup, str] = {}
"""Process groups on which a collective of this process failed, or was interrupted -> why no
later one may run on them (`CheckpointGroup._failing`). Kept by process group rather than by
`CheckpointGroup`: an HF export makes one of its own over its manager's group."""


class CheckpointGroup:
    """Ranks that save and load together.

    With `torch.distributed` initialised and no group given, a dedicated gloo group over every
    rank is created (collectively), so checkpoint traffic never queues behind training's
    collectives, with `timeout_s` on every collective. A group of every rank of the job given to
    a manager (`user`) names the ranks' order: a gloo group is made over them so (collectively,
    as without one: each rank makes the manager), since the training thread runs its own
    collectives on the group given (a gradient all-reduce, a barrier) while a background save
    runs DCP's, and two streams of collectives on one group pair up wrongly. A group of some of
    the ranks is used as it is (a group made by its ranks alone takes a name torch derives from
    each rank's count of groups, which ranks of uneven meshes do not share): it carries the
    checkpoint's collectives, from background threads too, and must be one the training does
    not use. A group used as given must serve CPU tensors (gloo; an NCCL-only group is
    refused). Without `torch.distributed` it is a group of one and every collective is local.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, timeout_s: float = COLLECTIVE_TIMEOUT_S,
                 user: str | None = None):
        self._arrivals: _Arrivals | None = None
        self._given: dist.ProcessGroup | None = None
        """The group given, while this group uses it (`_GIVEN`)."""
        self._timeout_s = timeout_s
        self._rounds = 0
        """Rounds of `run` this rank has entered: shared in each round, so ranks that are not in
        the same round (one left a round without gathering) fail instead of pairing up wrongly."""
        self.pg: dist.ProcessGroup | None = None
        self.global_ranks: list[int] | None = None
        """The job's rank of each rank of the group, where they differ (a subgroup): messages
        name both (`name`)."""
        if dist.is_available() and dist.is_initialized():
            if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
                raise ValueError(f"the process_group given is {process_group!r}, not a group: this rank (rank "
                                 f"{dist.get_rank()} of the world) is not in it (dist.new_group gives the ranks it "
                                 "leaves out GroupMember.NON_GROUP_MEMBER); make the CheckpointManager on the "
                                 "group's ranks only")
            ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
            own = ranks is not None and user is not None and sorted(ranks) == list(range(dist.get_world_size()))
            if process_group is not None and user is not None and not own and process_group in _GIVEN:
                raise ValueError(f"the process_group given carries the collectives of {_GIVEN[process_group]}, which "
                                 "is not closed: two managers' background saves on one group would cross their "
                                 "collectives (gloo aborts the process); pass none (each manager makes its own) or "
                                 "a group of its own")
            devices = _device_types(process_group) if process_group is not None and not own else ["cpu"]
            if "cpu" not in devices:  # an NCCL-only group: its collectives would take tensors on a GPU
                raise ValueError(
                    f"the process_group given serves only {devices} tensors; checkpoint collectives "
                    "exchange CPU objects: pass a group with a CPU backend "
                    "(dist.new_group(backend='gloo')), or none (one is made)")
            self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
            if ranks is not None and ranks != list(range(dist.get_world_size())):
                self.global_ranks = ranks
            self._made = process_group is None or own
            self._timeout = (f"checkpoint.collective_timeout_s = {timeout_s:g} s" if self._made else
                             "the process_group's timeout")
            if self._made:
                _warn_few_files(self.rank, self.world_size)
            with self._failing(alike=_MADE_ALIKE):  # made collectively: a rank that never comes times it out
                self.pg = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout_s),
                                         sort_ranks=False) if self._made else process_group
            if process_group is not None and user is not None and not own:
                _GIVEN[process_group], self._given = user, process_group
            if self._made and self.world_size > 1:  # over every rank (the job's), with the timeout it was made with
                self._arrivals = _Arrivals.of(self.pg, self.rank, self.world_size, timeout_s * _WARN_AFTER,
                                              self._warn_waiting)
        else:
            if process_group is not None:
                raise ValueError("a process_group was given but torch.distributed is not initialised")
            self.pg, self.rank, self.world_size, self._made = None, 0, 1, False

    def close(self) -> None:
        """Destroy the group made here (its sockets, pipes and threads: about 5 descriptors and 3
        threads a rank, which a process making a manager per evaluation ran out of), once this
        rank is done with its collectives; a group the caller gave is the caller's."""
        if self._arrivals is not None:
            self._arrivals.close(mark=dist.is_initialized())
        self._arrivals = None
        if self._given is not None:
            _GIVEN.pop(self._given, None)
            self._given = None
        if self._made and dist.is_initialized():
            try:
                dist.destroy_process_group(self.pg)
            except ValueError:  # gone with the world it was made in (re-initialised since: a restart in the process)
                pass
        if self._made:
            _BROKEN.pop(self.pg, None)
            self.pg = None  # its connections close with the last reference to it
        self._made = False

    def name(self, rank: int) -> str:
        """How messages name the group's `rank`: with its rank in the job where the two differ
        (a manager on a subgroup), the job's rank being whose log a user opens."""
        if self.global_ranks is None or not 0 <= rank < len(self.global_ranks):
            return f"rank {rank}"
        return f"rank {rank} of the checkpoint's group (rank {self.global_ranks[rank]} of the job)"

    def names(self, ranks: list[int]) -> str:
        """`ranks` of the group as messages name them (`name`), after "rank(s)"."""
        if self.global_ranks is None:
            return few(ranks)
        return f"{few(ranks)} of the checkpoint's group (of the job: {few([self.global_ranks[r] for r in ranks])})"

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @property
    def _broken(self) -> str | None:
        """Why this rank may not enter another collective on its group: one failed (gloo closes
        the connection to a peer that timed out), or it was interrupted inside one (a
        KeyboardInterrupt between the two exchanges of an object all-gather), so its next
        collective would pair with the rest of that one on the other ranks (garbage unpickled,
        or gloo aborting the process)."""
        return _BROKEN.get(self.pg) if self.pg is not None else None

    def _break(self, why: str) -> None:
        if self.pg is not None:
            _BROKEN[self.pg] = why

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        return self._all_gather(obj, self._arrive())

    def differing(self, value: Any) -> list[int]:
        """The ranks whose `value` (a digest of what each rank read) differs from rank 0's, on
        every rank: ranks that would go on from different files (a folder on node-local disks,
        a copy per node that differs) found before any of them acts on its own."""
        found = self.all_gather(value)
        return [rank for rank, theirs in enumerate(found) if theirs != found[0]]

    def _arrive(self) -> int:
        """Count this rank into its next round of collectives (`_Arrivals`); 0 where not counted."""
        return self._arrivals.enter() if self._arrivals is not None else 0

    def _all_gather(self, obj: Any, entered: int) -> list[Any]:
        if self.world_size == 1:  # a job of one rank: its group serves DCP's calls, no exchange is needed
            return [obj]
        found = [None] * self.world_size
        with self._failing(entered):
            dist.all_gather_object(found, obj, group=self.pg)
        return found

    @contextlib.contextmanager
    def _failing(self, entered: int = 0, alike: str = "calls save(step, last_step), load() and close() alike, "
                 "with the same arguments") -> Iterator[None]:
        """A collective's failure (gloo's timeout, a peer's closed connection) as a
        `CollectiveError` that says what to look for. With the round counted (`entered`), a wait
        past a share of the timeout is warned of, and a failure after such a wait names the ranks
        that had not entered the round (one that fails sooner is a peer's failure, not a wait:
        ranks merely slower than this one are not named). A rank interrupted inside one refuses
        every later one (`_broken`)."""
        if self._broken is not None:
            raise CollectiveError(self._broken)
        if self.world_size > 1 and not dist.is_initialized():  # DCP's calls would go on as a single process
            raise CollectiveError(f"rank {self.rank}: torch.distributed was shut down (destroy_process_group()) while "
                                  "the checkpoint still had collectives to run (a save in flight): call the manager's "
                                  "close(), or wait(), before destroy_process_group()")
        arrivals = self._arrivals if entered else None
        start = time.monotonic()
        if arrivals is not None:
            arrivals.watch(entered)
        try:
            yield
        except (CheckpointError, CheckpointException):  # a failure DCP's collectives carried to every rank
            raise
        except RuntimeError as e:
            waited = time.monotonic() - start
            behind = arrivals.behind(entered) if arrivals is not None and waited >= arrivals.warn_after_s else []
            who = (f"rank(s) {self.names(behind)} had not entered it after {waited:.0f} s (this rank waits "
                   f"{self._timeout}): stuck, in another call of the manager, or gone (see their logs)" if behind else
                   f"another rank did not join it within {self._timeout}, or failed, died or shut down "
                   "torch.distributed (see its log)")
            self._break(f"rank {self.rank}: an earlier collective among the checkpoint's {self.world_size} ranks "
                        f"failed ({e}), which leaves the ranks unable to pair their later ones: restart the job "
                        "(the last committed step is intact)")
            raise CollectiveError(
                f"a collective among the checkpoint's {self.world_size} ranks failed on {self.name(self.rank)} ({e}): "
                f"{who}. Every rank {alike}") from e
        except Exception:
            raise
        except BaseException as e:  # KeyboardInterrupt, a signal handler's SystemExit: part-way, maybe
            self._break(f"rank {self.rank} was interrupted ({type(e).__name__}) inside a collective among the "
                        f"checkpoint's {self.world_size} ranks, which cannot pair their later collectives with its "
                        "own any more: restart the job (the last committed step is intact)")
            raise
        finally:
            if arrivals is not None:
                arrivals.unwatch()

    def _warn_waiting(self, entered: int) -> None:
        """Called by the watch of a round still waiting after a share of the timeout: the lowest
        rank waiting (the first that has entered the round) warns of the ranks that have not."""
        arrivals = self._arrivals
        if arrivals is None or not arrivals.lowest_waiting(entered):
            return
        if behind := arrivals.behind(entered):
            logger.warning("a checkpoint collective has waited %g s (of %s) for rank(s) %s, which have not "
                           "entered it: stuck, or in another call of the manager (see their logs)",
                           self._timeout_s * _WARN_AFTER, self._timeout, self.names(behind))

    def run(self, fn: Callable[[], Any], coordinator_only: bool = False) -> list[Any]:
        """Run `fn` on every rank (or on rank 0 only), then share results and failures: returns
        every rank's result in rank order, or raises `RankFailed` on every rank if any rank
        failed (describing this rank's own failure first, else the lowest failing rank's; its
        `kinds` are those of every rank's failure, so every rank decides alike). A KeyboardInterrupt
        or SystemExit in `fn` (a signal's handler) is shared as a failure, then raised on its rank
        after the round; ranks found in different rounds raise `CollectiveError`."""
        result, error, interrupted = None, None, None
        self._rounds += 1
        entered = self._arrive()  # in the round from here: a rank at its part of it is not behind
        if not coordinator_only or self.is_coordinator:
            try:
                result = fn()
            except Exception as e:  # every rank must hear of it before anyone raises
                error = e
            except BaseException as e:  # KeyboardInterrupt, a signal handler's exit: raised after the round
                error = interrupted = e
        mine = None if error is None else (f"{type(error).__name__}: {error}",
                                           tuple(c.__name__ for c in type(error).__mro__))
        try:
            gathered = self._all_gather((self._rounds, result, mine), entered)
        except CollectiveError as e:
            if interrupted is not None:
                raise interrupted from e
            if error is not None:  # this rank's own failure, which its peers never heard of
                raise CollectiveError(f"{e} (this rank had failed first: {mine[0]})") from error
            raise
        if interrupted is not None:
            raise interrupted
        rounds = [g[0] if type(g) is tuple and len(g) == 3 else "another exchange" for g in gathered]
        if len(set(rounds)) > 1:
            raise CollectiveError(
                f"the checkpoint's ranks are out of step: rank {self.rank} is in its round {self._rounds} of "
                f"checkpoint collectives, the ranks' rounds are {rounds}; a rank left a save(), load() or close() "
                "part-way (interrupted by a signal, or an error outside them), or the ranks called them otherwise, "
                "and they cannot pair their collectives any more. Restart the job: the last committed step is intact")
        failed = [(r, f) for r, (_, _, f) in enumerate(gathered) if f is not None]
        if failed:
            rank, (message, _) = next(((r, f) for r, f in failed if r == self.rank), failed[0])
            kinds = tuple(dict.fromkeys(kind for _, (_, ks) in failed for kind in ks))
            raise RankFailed(rank, message, kinds, error, self.name(rank)) from error
        return [r for _, r, _ in gathered]

    def each(self, fn: Callable[[], T], what: str) -> T:
        """`fn()` on every rank in a round of its own, this rank's result returned (not shared).
        For a rank's own reads from a store before a collective: a failure on any rank (a store
        failing on one node) is a `CheckpointError` on every rank naming `what` (`RankFailed.reraise`),
        where the other ranks would otherwise wait in the next collective until its timeout."""
        mine: list[T] = []
        try:
            self.run(lambda: mine.append(fn()))
        except RankFailed as failed:
            failed.reraise(what)
        return mine[0]

    @contextlib.contextmanager
    def carrying(self) -> Iterator[None]:
        """Around a call that runs collectives of its own on `pg` (`dcp.save`): a collective of
        it that fails (gloo's timeout, raised as it is: DCP carries its steps' own failures to
        every rank in a `CheckpointException`, which passes) fails as this group's own do."""
        with self._failing(self._arrive()):
            yield

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        with self._failing(self._arrive()):
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.pg, 0), group=self.pg)
        return box[0]


class _Arrivals:
    """How many rounds of checkpoint collectives each rank of a group has entered, one counter
    per rank in the job's rendezvous store: gloo's timeout says only that this rank's wait ran
    out, where an operator of many ranks needs the ones that never came (one store request per
    round). A counter holds 1 + the rounds entered (0, or missing: not known), and a huge value
    once its rank closed the group (never behind). A thread of its own watches each wait: one
    still waiting after `warn_after_s` has `warn(entered)` called. The thread ends once no round
    came for `_IDLE_S` (groups of one-off calls are never closed); the next round starts one."""

    _IDLE_S = 30.0
    _CLOSED = 1 << 40

    _made: dict[str, int] = {}
    """Counters made per group name in this process: every rank makes a group's in the same order
    (checkpoint groups are made collectively), so the n-th of each rank share their keys."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, warn_after_s: float,
                 warn: Callable[[int], None]):
        self._store, self._rank, self._world_size = store, rank, world_size
        self.warn_after_s, self._warn = warn_after_s, warn
        self.entered = 0
        """The rounds this rank has entered."""
        self._broken = False
        """A store request failed: the counters may be off, so no rank is named any more."""
        self._changed = threading.Condition()
        self._waiting: tuple[float, int] | None = None
        """(when to warn, `entered`) of the wait in progress, if any."""
        self._watcher: threading.Thread | None = None
        self._closed = False

    @classmethod
    def of(cls, pg: dist.ProcessGroup, rank: int, world_size: int, warn_after_s: float,
           warn: Callable[[int], None]) -> _Arrivals | None:
        """Counters for `pg` in the default group's store, apart from those of any earlier
        checkpoint group of its name; None where this torch has no such store to reach (ranks
        are then not named)."""
        try:
            store = dist.distributed_c10d._get_default_store()
            made = cls._made[pg.group_name] = cls._made.get(pg.group_name, 0) + 1
            arrivals = cls(dist.PrefixStore(f"torchtitan_ckpt/arrivals/{pg.group_name}/{made}/", store), rank,
                           world_size, warn_after_s, warn)
            arrivals._store.add(str(rank), 1)
            return arrivals
        except (AttributeError, RuntimeError, ValueError):
            return None

    def enter(self) -> int:
        """Count this rank into its next round; returns how many it has entered."""
        self.entered += 1
        if not self._broken:
            try:
                self._store.add(str(self._rank), 1)
            except RuntimeError:  # the store is gone (its host died): the collective fails on its own
                self._broken = True
        return self.entered

    def watch(self, entered: int) -> None:
        """Watch a wait in round `entered`, from now."""
        with self._changed:
            self._waiting = (time.monotonic() + self.warn_after_s, entered)
            if self._watcher is None or not self._watcher.is_alive():  # ended idle, or in a forked child
                try:
                    self._watcher = threading.Thread(target=self._watching, name="ckpt-collective-watch",
                                                     daemon=True)
                    self._watcher.start()
                except RuntimeError:  # no thread to be had: the wait goes unwatched, the collective as ever
                    self._watcher = None
            self._changed.notify()

    def unwatch(self) -> None:
        with self._changed:
            self._waiting = None

    def _watching(self) -> None:
        with self._changed:
            while not self._closed:
                if self._waiting is None:
                    if not self._changed.wait(self._IDLE_S) and self._waiting is None:
                        self._watcher = None
                        return
                    continue
                at, entered = self._waiting
                if (wait := at - time.monotonic()) > 0:
                    self._changed.wait(wait)
                    continue
                self._waiting = None  # warned of once
                self._changed.release()
                try:
                    self._warn(entered)
                finally:
                    self._changed.acquire()

    def _rounds(self, ranks: list[int]) -> list[int] | None:
        """The rounds `ranks` have entered (-1: not known; a huge number: closed), in one request;
        None where the store cannot tell (a request failed, or a counter is missing)."""
        keys = [str(r) for r in ranks]
        try:
            if self._broken or not self._store.check(keys):
                return None
            return [int(v) - 1 for v in self._store.multi_get(keys)]
        except (RuntimeError, ValueError):
            return None

    def behind(self, entered: int) -> list[int]:
        """The ranks known to have entered fewer than `entered` rounds ([] where not known)."""
        rounds = self._rounds(list(range(self._world_size))) or []
        return [r for r, n in enumerate(rounds) if 0 <= n < entered]

    def lowest_waiting(self, entered: int) -> bool:
        """Whether no lower rank has entered round `entered` (this rank warns, not every rank
        waiting): the ranks below are asked one at a time, most often only rank 0."""
        for r in range(self._rank):
            rounds = self._rounds([r])
            if rounds is None or rounds[0] < 0:
                return False
            if entered <= rounds[0] < self._CLOSED - 1:  # waiting too (a closed rank waits for nothing)
                return False
        return True

    def close(self, mark: bool = True) -> None:
        """Stop the watch, and with `mark` (the job's store is still there: its world was not
        destroyed) mark this rank's counter closed: a peer still in a round, or reporting one,
        does not take it for a rank that never came."""
        with self._changed:
            self._closed = True
            self._changed.notify()
        if mark and not self._broken:
            try:
                self._store.add(str(self._rank), self._CLOSED)
            except RuntimeError:
                pass


_FILES_BESIDE = 64
"""Files a process opens besides a gloo group's connections while it saves and loads (data
files, the rendezvous, the writer's pipes): room `_warn_few_files` leaves."""


def _warn_few_files(rank: int, world_size: int) -> None:
    """A gloo group holds a connection to every other rank, each an open file: where this
    process may not open that many more (`ulimit -n`, often 1024 by default, against jobs of
    thousands of ranks), making the group fails with gloo's "Too many open files" on the ranks
    that run out, and the others wait for them. Said before, with the way out."""
    try:
        allowed = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        now = len(os.listdir("/proc/self/fd"))
    except (OSError, ValueError):  # no /proc: nothing to say
        return
    if allowed != resource.RLIM_INFINITY and now + world_size + _FILES_BESIDE > allowed:
        logger.warning("rank %d: the checkpoint's gloo group of %d ranks holds a connection to each, and this process "
                       "has %d files open of the %d it may open (ulimit -n): making the group may fail with 'Too "
                       "many open files'; raise the limit to at least %d (ulimit -n, or the launcher's setting)",
                       rank, world_size, now, allowed, now + world_size + _FILES_BESIDE)


_cpu_worlds: dict[dist.ProcessGroup, dist.ProcessGroup] = {}
"""Default group (one that carries no CPU tensors) -> the gloo group over its ranks made for it."""


def refuse_unjoined_launch() -> None:
    """A process torchrun launched as one of several ranks (`WORLD_SIZE` above 1) whose default
    process group is not initialised: a manager made there is a job of one on each rank, each
    saving alone over the others' steps (or failing on the first one's lock as on another
    job's). Refused, with the call that joins the ranks."""
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched not in ("", "0", "1") and not (dist.is_available() and dist.is_initialized()):
        raise CheckpointError(
            f"this process was launched as rank {os.environ.get('RANK', '?')} of WORLD_SIZE = {launched} "
            "(torchrun), and torch.distributed is not initialised: each rank would save alone, over the "
            "others' steps. Call torch.distributed.init_process_group() before making the CheckpointManager")


def cpu_world() -> dist.ProcessGroup | None:
    """A group of every rank that carries CPU tensors: the default group where it does (gloo, or
    TorchTitan's "cpu:gloo,cuda:nccl"), else a gloo group made (collectively) the first time and
    kept, so that one-off calls (`load_hf`, `save_hf`) do not each make one; None without
    `torch.distributed`."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    if "cpu" in _device_types(world):
        return world
    if world not in _cpu_worlds:
        _cpu_worlds[world] = dist.new_group(backend="gloo")
    return _cpu_worlds[world]


def _device_types(group: dist.ProcessGroup) -> list[str]:
    return [d.type for d in group._device_types]


@contextlib.contextmanager
def launched_group(backend: str = "gloo") -> Iterator[None]:
    """The default process group a launcher (torchrun) asks for through `WORLD_SIZE`, initialised
    for the duration of the block and destroyed after it, once every rank is through the block
    when it ends well (a rank tearing its connections down while a peer still has work on them
    aborted that peer now and then, "terminate called without an active exception"); nothing
    when not launched so, or when the caller initialised one already.

    On gloo that wait is `monitored_barrier`, whose messages the calling thread sends and
    receives: gloo's `barrier` is queued to its worker threads and holds on to the collectives
    still finishing there, whose tensors it then frees on a worker thread as the process exits,
    where a Python object freed during the interpreter's shutdown aborts the process with the
    same message (a launched rank's entry point leaves without that shutdown: `leave`)."""
    launched = "WORLD_SIZE" in os.environ and not dist.is_initialized()
    if launched:
        logger.info("joining the WORLD_SIZE = %s ranks (torchrun's) at %s:%s; waits until each has started (a "
                    "WORLD_SIZE set by hand, with no other rank started, waits until torch.distributed's timeout)",
                    os.environ["WORLD_SIZE"], os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?"))
        dist.init_process_group(backend)
    try:
        yield
        if launched and dist.get_backend() == "gloo":
            dist.monitored_barrier()
        elif launched:
            dist.barrier()
    finally:
        if launched:
            dist.destroy_process_group()


def leave(code: int) -> NoReturn:
    """End the process with exit status `code`. A rank torchrun launched (`WORLD_SIZE` set) ends
    without the interpreter's teardown, once its logs and output are flushed: gloo's worker
    threads may still be letting go of the tensors of finished collectives then, and one that
    takes the GIL during finalization aborts the process after its work succeeded ("terminate
    called without an active exception", pytorch/pytorch#179291). For the end of a program only:
    its managers closed and its process group destroyed, as `atexit` handlers do not run."""
    if "WORLD_SIZE" not in os.environ:
        sys.exit(code)
    try:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):  # a reader gone (a closed pipe): the status still says how the work ended
        pass
    os._exit(code)
