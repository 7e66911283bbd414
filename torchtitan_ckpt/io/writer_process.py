"""A process that writes one rank's data files, so writing never competes with training for
the GIL (`async_mode = "async_with_pinned_mem"`).

The training process stages the state into a long-lived shared-memory arena and keeps running
DCP's planning and commit (collectives on the manager's gloo group, a few small messages). Only
the byte-moving part of a save, `filewriter.write_files`, runs here: the writer has no process
group and no DTensors, just files to write from shared memory. Each shared storage (the arena) is
handed over once (its file descriptor, sent beside the message: `fd_shared`) and named by an id
afterwards, so a save sends only a list of (buffer id, view) references and small values through
a pipe. A save hands over the files it can write before DCP has planned while the state is still
being staged (`start`); the writer waits for each tensor's copy on a shared-memory count
(`filewriter.CountWait`) and writes what it is handed in order, and a thread of the training
process receives the replies.

The writer dies with its rank: it asks the kernel for SIGKILL when the thread that started it
exits (Linux), which is one thread of this module's that lives as long as the process
(`_on_launcher`), and exits when the pipe closes. A fail point it reaches kills its rank as well,
so crash tests see what a killed rank would leave.
"""

from __future__ import annotations

import collections
import io
import logging
import multiprocessing.process
import multiprocessing.spawn
import multiprocessing.util
import os
import pickle
import queue
import signal
import socket
import threading
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from itertools import count
from multiprocessing import connection, resource_tracker
from typing import Any

import torch
import torch.multiprocessing as mp

from .. import faults
from ..errors import InWriterProcess, WriterProcessError
from .filewriter import CountWait, Entry, FileJob, StartedFiles, WrittenFile, linux_libc, planned_places, write_files

logger = logging.getLogger(__name__)

_STOP = None

_LIVENESS_S = 1.0
"""How often the reply thread, with no reply to read, asks whether the writer still runs: its
pipe's closing tells its end only where no other process holds the writer's end (a process
forked on another thread while the writer started, a data loader's worker, holds it)."""

_IDLE_STOP_S = 10.0
"""How long `close()` lets a writer with no work in progress take to stop before killing it."""


class WriterProcess:
    """The training side of one rank's writer process; calling it is a `filewriter.Sink`, and
    `start` hands it files to write while the caller goes on.

    It may be made on any thread (one that ends, too: a notebook's, a service's), and called from
    any one thread at a time (the background save thread). The process writes what
    it is handed in order; a thread of this process receives its replies, in the same order."""

    def __init__(self) -> None:
        if _EXITING.is_set():  # it would outlive the hook that closes writers, and the exit would wait on it
            raise WriterProcessError("the process is exiting (its main thread ended): no checkpoint writer process is "
                                     "started any more")
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._fds, child_fds = socket.socketpair()  # the descriptors' own channel, blocking under
        self._fds.settimeout(None)  # socket.setdefaulttimeout (a socket object on the pipe's fd made it not)
        self._proc = ctx.Process(target=_serve, args=(child_conn, child_fds, os.getpid()), daemon=True,
                                 name="ckpt-writer")
        _on_launcher(self._start)
        child_conn.close()
        child_fds.close()
        self._ids = count()
        self._registered: dict[tuple[int, int], tuple[int, torch.UntypedStorage]] = {}
        """(data_ptr, nbytes) of a shared storage -> (id, the storage, kept alive so its address
        cannot be reused by another buffer while the writer maps it)."""
        self._used: set[tuple[int, int]] = set()
        """The shared storages named since the last call: the others are dropped by the next."""
        self._waiting: collections.deque[Future] = collections.deque()
        self._lock = threading.Lock()
        self._reap = threading.Lock()
        """Held by whoever asks whether the writer runs, waits for it or kills it: two threads
        reaping one child at once make `multiprocessing` report it running after it exited (the
        loser's `waitpid` fails), and a kill then aims at a process id the kernel may reuse."""
        self._gone: BaseException | None = None
        self._stopped = False
        """Told to stop without a wait (`stop`): its reply thread lets go of it once it has."""
        self._replies = threading.Thread(target=self._receive, name="ckpt-writer-replies", daemon=True)
        self._replies.start()
        _OPEN.add(self)
        _close_before_children_joined()

    def _start(self) -> None:
        """Leaves the process's default start method as it was: `spawn` asks for it (to hand it
        to the child), which fixes it where none was set, and a host's later
        `multiprocessing.set_start_method` would fail ("context has already been set")."""
        unset = mp.get_start_method(allow_none=True) is None
        try:
            with _main_hidden():
                self._proc.start()
        finally:
            if unset:
                mp.set_start_method(None, force=True)

    def __call__(self, jobs: list[FileJob], step: int | None = None, sync: bool = True) -> list[WrittenFile]:
        """Write `jobs` in the writer process; returns once they are durable there. The shared
        storages that neither these jobs nor a `start` since the last call name are dropped
        (the writer unmaps them)."""
        return self._send(jobs, step, sync, drop=True).result()

    def start(self, jobs: list[FileJob], step: int | None = None, sync: bool = True) -> StartedFiles:
        """Start writing `jobs` in the writer process, after what it was handed before; an
        entry's `ready` must be a `CountWait` or None (it runs in that process). Where each
        entry will land is worked out here as well (`planned_places`), so the caller need not
        wait for the writes to know it."""
        places = [planned_places(job) for job in jobs]  # first: a failure here leaves nothing writing
        return StartedFiles(self._send(jobs, step, sync, drop=False), places)

    def _send(self, jobs: list[FileJob], step: int | None, sync: bool, drop: bool) -> Future:
        """Hand `jobs` over; the future of their `WrittenFile`s, set when the writer replies."""
        register: dict[int, torch.Tensor] = {}
        files = []
        for job in jobs:
            for e in job.entries:
                if e.ready is not None and not isinstance(e.ready, CountWait):
                    raise TypeError(f"an entry for the writer process waits on {e.ready!r}, not a CountWait")
            files.append((job.path, [(e.key, self._ref(e.data, register), e.ready) for e in job.entries], job.direct))
        dropped = [k for k in self._registered if k not in self._used] if drop else []
        try:  # pickled first: a message that cannot be is refused before a byte reaches the writer
            message, fds = _pickled({"step": step, "sync": sync, "register": register, "files": files,
                                     "drop": [self._registered[k][0] for k in dropped]})
        except Exception as e:
            for key in [k for k, (buffer_id, _) in self._registered.items() if buffer_id in register]:
                del self._registered[key]  # never sent: the writer does not know them
            raise WriterProcessError(f"the files to write cannot be handed to the writer process: "
                                     f"{type(e).__name__}: {e}") from e
        for key in dropped:
            del self._registered[key]
        if drop:
            self._used = set()
        done: Future = Future()
        with self._lock:
            if self._gone is not None:
                raise self._gone
            self._waiting.append(done)
            try:
                _send(self._conn, self._fds, message, fds)
            except BaseException as e:
                self._waiting.pop()
                self._registered.clear()
                self._kill()  # what it has read of a message is unknown: the next save starts a new one
                raise self._lost(e) if isinstance(e, OSError) else e
        return done

    def _receive(self) -> None:
        """Each reply, to the oldest call still waiting. Once the pipe closes, or anything else
        goes wrong here (a reply that cannot be read, one nobody waits for), every call waiting,
        and every later one, fails, and a writer still running is stopped (its replies could
        not be matched to their calls any more; the next save starts a new one)."""
        try:
            while True:
                while not self._conn.poll(_LIVENESS_S):
                    if not self.alive:  # its end of the pipe held open by a process forked while it started
                        raise EOFError("the writer exited")
                status, value = self._conn.recv()
                with self._lock:
                    done = self._waiting.popleft()
                if status == "error":
                    error, where = value
                    error.__cause__ = InWriterProcess(where)
                    done.set_exception(error)
                else:
                    done.set_result([WrittenFile(size, places, lambda crc=crc: crc) for size, crc, places in value])
        except BaseException as e:
            if not isinstance(e, EOFError):
                self._kill()
            with self._lock:
                self._gone = self._lost(e)
                waiting, self._waiting = list(self._waiting), collections.deque()
            for done in waiting:
                if not done.done():
                    done.set_exception(self._gone)
            if self._stopped:
                self._registered.clear()
                _OPEN.discard(self)

    def _lost(self, e: BaseException) -> WriterProcessError:
        return WriterProcessError(f"the checkpoint writer process exited (exit code {self.exitcode}): "
                                  f"{type(e).__name__}: {e}")

    def _ref(self, data: Any, register: dict[int, torch.Tensor]) -> Any:
        """What the writer needs to find `data`: bytes as they are, a tensor in a shared
        storage as (id, dtype, offset, size, stride), any other tensor by value."""
        if not isinstance(data, torch.Tensor) or data.device.type != "cpu":
            return data if not isinstance(data, torch.Tensor) else data.detach().cpu()
        storage = data.untyped_storage()
        if _fd_of(storage) is None:  # not shared, or shared by name (another's: sent by value, its bytes alone)
            return data.detach() if data.nbytes == storage.nbytes() else data.detach().clone()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in self._registered:
            buffer_id = next(self._ids)
            self._registered[key] = (buffer_id, storage)
            register[buffer_id] = torch.empty(0, dtype=torch.uint8, device="cpu").set_(storage)
        self._used.add(key)
        return ("buffer", self._registered[key][0], data.dtype, data.storage_offset(),
                tuple(data.shape), tuple(data.stride()))

    @property
    def pid(self) -> int | None:
        """The writer's process id, for the log (None before it started)."""
        return self._proc.pid

    @property
    def alive(self) -> bool:
        with self._reap:
            return self._proc.is_alive()

    @property
    def exitcode(self) -> int | None:
        """The writer's exit code (None while it runs; a dying writer, whose pipe closes a moment
        before it can be reaped, gets 1 s to finish)."""
        self._join(1.0)
        with self._reap:  # reading it reaps an exited writer too
            return self._proc.exitcode

    def _join(self, timeout: float | None) -> bool:
        """Wait up to `timeout` s for the writer to exit (several threads may wait at once; one
        reaps it); whether it still runs."""
        exited = bool(connection.wait([self._proc.sentinel], timeout))
        with self._reap:
            if exited:
                self._proc.join()  # its pipe closed: it is gone, or a moment from being reapable
            return self._proc.is_alive()

    def _kill(self) -> None:
        """Kill the writer if it runs (not yet reaped, so its process id is still its own)."""
        with self._reap:
            if self._proc.is_alive():
                self._proc.kill()

    def stop(self) -> None:
        """Tell the writer to stop, without waiting for it (its owner was collected unclosed, and
        this may run inside a garbage collection on any thread, this writer's reply thread
        included: no lock is taken; no save sends by then, and a stop sent twice, with the
        exit's `close`, is read once). Once it has stopped, the reply thread drops the shared
        buffers and lets go of this writer."""
        self._stopped = True
        try:
            _send(self._conn, self._fds, *_pickled(_STOP))
        except OSError:  # gone already
            pass

    def close(self) -> None:
        """Stop the writer (after the writes in progress, if any) and wait for it to exit. With
        nothing in progress nothing can be lost: one that has not stopped within
        `_IDLE_STOP_S` (still starting: spawning and importing torch can take over 30 s on a
        loaded machine, and it reads the stop only once up) is killed, and that is no warning."""
        with self._lock:
            idle = not self._waiting
            try:
                _send(self._conn, self._fds, *_pickled(_STOP))
            except OSError:
                pass
        if self._join(_IDLE_STOP_S if idle else 30):
            if idle:
                logger.debug("the idle checkpoint writer process did not stop at once; killing it")
            else:
                logger.warning("the checkpoint writer process did not stop; killing it")
            self._kill()
        self._join(None)
        self._replies.join()
        self._conn.close()
        self._fds.close()
        self._registered.clear()
        _OPEN.discard(self)


_OPEN: set[WriterProcess] = set()
"""Writers this process started and has not closed or stopped (`stop`, for an owner collected
unclosed). At exit `multiprocessing` joins every child after a SIGTERM the writer ignores:
`_close_at_exit` closes them first."""


_EXITING = threading.Event()
"""Set by `_close_at_exit`: a thread still saving then (a daemon's, or one the main thread did
not wait for) starts no writer, which nothing would close."""


def _close_at_exit() -> None:
    """Close the writers this process started and nobody closed. Registered on import, before any
    manager's own exit hook (`staging._wait_at_exit`), so it runs after them: a save in flight
    is waited for first."""
    _EXITING.set()
    for writer in list(_OPEN):  # a forked child's is empty (`_forget_writers`)
        writer.close()


if (_register_atexit := getattr(threading, "_register_atexit", None)) is not None:
    _register_atexit(_close_at_exit)


_FINALIZED: set[int] = set()
"""The processes where `_close_before_children_joined` is registered."""


def _close_before_children_joined() -> None:
    """In a process `multiprocessing` started (a `torch.multiprocessing.spawn` rank), whose end
    joins its children before the interpreter's exit hooks run: `_close_at_exit` in a finalizer
    of that process, run before the join (priority 0 and more). Once per process, by its first
    writer (a finalizer registered before a fork is not run in the child)."""
    if os.getpid() not in _FINALIZED:
        _FINALIZED.add(os.getpid())
        multiprocessing.util.Finalize(None, _close_at_exit, exitpriority=0)


def _forget_writers() -> None:
    """In a child forked by `os.fork`: the writers are its parent's children, which
    `multiprocessing`'s exit hook in the child would try to join (and fail on, before the hooks
    after it, a `multiprocessing.Queue`'s flush among them)."""
    for writer in _OPEN:
        multiprocessing.process._children.discard(writer._proc)  # type: ignore[attr-defined]
    _OPEN.clear()


os.register_at_fork(after_in_child=_forget_writers)


@contextmanager
def _main_hidden() -> Iterator[None]:
    """While the writer starts, hide the user's `__main__` from `spawn`, so the child runs only
    this module: it would otherwise run the training script again, and one without an
    `if __name__ == "__main__":` guard would start training in the writer, which then dies.
    Only this thread's start is told of no `__main__`: `sys.modules` is left as it is, as another
    thread of the job may be pickling an object of the script's classes meanwhile, and whatever
    `spawn.get_preparation_data` is now (another library's wrapper) is called as it is, and put
    back after, unless it was replaced meanwhile."""
    before, starting = multiprocessing.spawn.get_preparation_data, threading.get_ident()

    def preparation_data(name: str) -> dict[str, Any]:
        data = before(name)
        if threading.get_ident() == starting:
            data.pop("init_main_from_name", None)
            data.pop("init_main_from_path", None)
        return data

    multiprocessing.spawn.get_preparation_data = preparation_data
    try:
        yield
    finally:
        if multiprocessing.spawn.get_preparation_data is preparation_data:
            multiprocessing.spawn.get_preparation_data = before


_launcher: tuple[int, queue.SimpleQueue] | None = None
"""(this process's id, the queue of its launcher thread): a forked child makes its own."""
_launcher_lock = threading.Lock()


def _on_launcher(fn: Callable[[], None]) -> None:
    """Run `fn` (a writer's start) on the one thread of this process that starts writers, and
    wait for it. The kernel's death signal fires when the thread that started a child exits,
    not its process: a writer started by a thread that then ended (training run in a thread
    that returns, the main thread left to exit) was killed, and the save in flight lost. This
    thread lives as long as the process (a daemon, never joined: not before the exit's wait for
    the save in flight either)."""
    global _launcher
    with _launcher_lock:
        if _launcher is None or _launcher[0] != os.getpid():
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_launch, args=(jobs,), name="ckpt-writer-launcher", daemon=True).start()
            _launcher = (os.getpid(), jobs)
        jobs = _launcher[1]
    done: Future = Future()
    jobs.put((fn, done))
    done.result()


def _launch(jobs: queue.SimpleQueue) -> None:
    # a writer inherits this thread's blocked signals across its exec: those it ignores cannot
    # kill it while it starts (importing torch takes seconds), before `_serve` can ignore them.
    # multiprocessing's resource tracker, started by a process's first spawn, unblocks SIGINT and
    # SIGTERM on the thread that starts it (a Ctrl-C then killed the first writer as it started,
    # and the save in flight with it): started first, then the signals blocked before each start
    while True:
        fn, done = jobs.get()
        try:
            resource_tracker.ensure_running()
            signal.pthread_sigmask(signal.SIG_BLOCK, _ignored_signals())
            done.set_result(fn())
        except BaseException as e:  # handed to the caller waiting for it
            done.set_exception(e)


def _die_with_parent(parent: int) -> None:
    if (libc := linux_libc()) is not None:
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


_LEFT_TO_THE_RANK = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
"""Signals a job's launcher or terminal sends to every process of the job: the writer ignores
them, so that the save in flight ends as the rank decides (a rank that handles one may still
save); it dies with its rank (`_die_with_parent`)."""


def _ignored_signals() -> list[signal.Signals]:
    return [getattr(signal, name) for name in _LEFT_TO_THE_RANK if hasattr(signal, name)]


def _serve(conn, fds: socket.socket, parent: int) -> None:
    """The writer's loop: write what each message lists, answer with the results or the error."""
    for sig in _ignored_signals():
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _ignored_signals())  # blocked since its start: see `_launch`
    _die_with_parent(parent)
    faults.kill_also(parent)
    torch.set_num_threads(1)
    fds.settimeout(None)
    buffers: dict[int, torch.Tensor] = {}
    while True:
        try:
            msg = _received(conn, fds)
        except (EOFError, OSError):
            return
        except Exception as e:  # read, but its shared memory not mapped: told, and the next save starts
            conn.send(("error", (_picklable(e), traceback.format_exc())))  # a writer that knows every buffer
            return
        if msg is _STOP:
            return
        try:
            for buffer_id in msg["drop"]:
                buffers.pop(buffer_id, None)
            buffers.update(msg["register"])
            jobs = [FileJob(path, [Entry(key, _resolve(ref, buffers), ready) for key, ref, ready in entries], direct)
                    for path, entries, direct in msg["files"]]
            reply = ("ok", [(w.size, w.durable(), w.places) for w in write_files(jobs, msg["step"], msg["sync"])])
        except Exception as e:  # handed to the training process, which raises it, with where it was raised
            reply = ("error", (_picklable(e), traceback.format_exc()))
        conn.send(reply)


def _resolve(ref: Any, buffers: dict[int, torch.Tensor]) -> Any:
    if isinstance(ref, tuple) and ref and ref[0] == "buffer":
        _, buffer_id, dtype, offset, size, stride = ref
        return torch.empty(0, dtype=dtype, device="cpu").set_(buffers[buffer_id].untyped_storage(), offset, size,
                                                             stride)
    return ref


def fd_shared(t: torch.Tensor) -> torch.Tensor:
    """`t`, its storage moved into shared memory that a file descriptor names, whatever torch's
    sharing strategy: the writer maps it from a copy of that descriptor sent over its pipe
    (`_pickled`). A segment shared by name (the `file_system` strategy) is freed when a forked
    child that inherited it exits (it drops the last reference it counts), and every later save
    fails; one named by a descriptor lives until every process holding it closed it, and leaves
    nothing behind when one is killed."""
    t.untyped_storage()._share_fd_cpu_()
    return t


def _fd_of(storage: torch.UntypedStorage) -> int | None:
    """The descriptor of a CPU storage in shared memory named by one (`fd_shared`), else None."""
    if storage.device.type != "cpu" or not storage.is_shared():
        return None
    try:
        fd = storage._get_shared_fd()
    except RuntimeError:  # shared by name
        return None
    return fd if fd >= 0 else None  # an empty one, or a file's map


class _FdPickler(pickle.Pickler):
    """Pickles every storage in shared memory named by a descriptor as its place in `fds`
    (sent beside the bytes: no server process or socket file of `multiprocessing`'s is needed,
    as torch's own reduction would start); any other storage as its bytes (a plain pickle of
    one of a dtype of no Python storage class, float8 or uint16, does not load)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.fds: list[int] = []
        self._places: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):  # a tensor's, of most dtypes
            storage, dtype = obj._untyped_storage, obj.dtype
        elif isinstance(obj, torch.UntypedStorage):  # one of a dtype of no storage class (float8, uint16)
            storage, dtype = obj, None
        else:
            return None
        if (fd := _fd_of(storage)) is None:
            raw = torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes() if storage.nbytes() else b""
            return ("bytes", raw, dtype)
        place = self._places.setdefault(fd, len(self.fds))
        if place == len(self.fds):
            self.fds.append(fd)
        return ("fd", place, storage.nbytes(), dtype)


class _FdUnpickler(pickle.Unpickler):
    """Reads what `_FdPickler` wrote, mapping each storage from its descriptor in `fds`."""

    def __init__(self, file: io.BytesIO, fds: list[int]) -> None:
        super().__init__(file)
        self._fds = fds
        self._mapped: dict[int, torch.UntypedStorage] = {}

    def persistent_load(self, pid: Any) -> Any:
        if pid[0] == "bytes":
            _, raw, dtype = pid
            storage = torch.frombuffer(bytearray(raw), dtype=torch.uint8).untyped_storage() if raw else \
                torch.UntypedStorage(0)
        else:
            _, place, nbytes, dtype = pid
            if place not in self._mapped:
                self._mapped[place] = torch.UntypedStorage._new_shared_fd_cpu(self._fds[place], nbytes)
            storage = self._mapped[place]
        # torch's rebuild of a tensor of a dtype of no storage class takes its bytes' typed storage
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype or torch.uint8, _internal=True)


def _pickled(obj: Any) -> tuple[bytes, list[int]]:
    """`obj` for the writer: its bytes and the descriptors to send with them."""
    buf = io.BytesIO()
    pickler = _FdPickler(buf)
    pickler.dump(obj)
    return buf.getvalue(), pickler.fds


_FDS_PER_SEND = 253
"""The most descriptors Linux passes in one message (`SCM_MAX_FD`): a writer started for a
state of many arenas is handed them all at once."""


def _send(conn: connection.Connection, fds_sock: socket.socket, message: bytes, fds: list[int]) -> None:
    """One message to the writer: the count of descriptors and the pickle over the pipe, then
    the descriptors over the socket pair of their own."""
    conn.send_bytes(len(fds).to_bytes(4, "little") + message)
    for start in range(0, len(fds), _FDS_PER_SEND):
        socket.send_fds(fds_sock, [b"F"], fds[start:start + _FDS_PER_SEND])


def _received(conn: connection.Connection, fds_sock: socket.socket) -> Any:
    """The writer's side of `_send`. The descriptors are closed once the storages they name are
    mapped (or the message failed: each that arrived)."""
    raw = conn.recv_bytes()
    count = int.from_bytes(raw[:4], "little")
    fds: list[int] = []
    try:
        for start in range(0, count, _FDS_PER_SEND):
            wanted = min(_FDS_PER_SEND, count - start)
            _, got, _, _ = socket.recv_fds(fds_sock, 1, wanted)
            fds.extend(got)
            if len(got) != wanted:  # this process's limit of open files, say
                raise RuntimeError(f"the writer process received {len(fds)} of the {count} shared buffers sent")
        return _FdUnpickler(io.BytesIO(raw[4:]), fds).load()
    finally:
        for fd in fds:
            os.close(fd)


def _picklable(e: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
