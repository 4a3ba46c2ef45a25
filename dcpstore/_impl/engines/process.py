"""The process engine: the native save, run in a persistent checkpoint process per rank.

Every other engine runs the background half of a save -- planning,
serialisation, CRC32C, the storage's requests, the commit -- on threads of
the training process, where it competes with training for the GIL and the
CPU. This one runs it in a checkpoint process of the rank's own (as NVRx's
persistent worker and torch's process executor do), started on the first
save and kept for the next ones. What it runs there is the native engine's
save (:func:`dcpstore._impl.dcp.writer.save_state_dict`): the same commit,
checksums, names and failure reporting, on every backend.

Per rank, per save::

    caller's thread      stage into shared memory (a Slab: engines/shared_memory.py)
    saver's thread       [the first save, or a checkpoint process gone on any
                         rank (one all-reduce): every rank starts a new one;
                         they form a gloo group of their own, meeting at a
                         TCPStore rank 0's trainer serves]
                         send the job -- the staged copy's skeleton, the
                         slab's descriptor (once per process), the options,
                         this process's environment -- and wait for the
                         outcome or the process's end
    checkpoint process   rebuild the state dict over the slab; every rank
                         ready (one all-reduce: a rank that cannot start the
                         save fails it everywhere, nobody waits for it); the
                         DCP save on its own group; reply SaveStats or the error
    saver's thread       agree on the outcome (one all-reduce, and an
                         all-gather when a checkpoint process died): every
                         rank raises when any failed, naming the ranks whose
                         checkpoint process died and how

A checkpoint process that dies (SIGKILL, OOM) fails its save with a
:class:`~dcpstore.SaveError` naming the rank, on every rank, and never
hangs: its trainer sees the socket close at once, and the others'
processes see their gloo peer go. gloo tells only the ranks that talk to
the dead one directly, so a checkpoint process whose save failed leaves at
once: its own peers see it go in turn, and the failure reaches every rank
however many there are. The next save starts new processes on every rank. A checkpoint process never outlives its trainer: it is killed
with it (``PR_SET_PDEATHSIG``), and it leaves when the socket closes. It
ignores SIGINT, as the native engine's threads do: Ctrl-C reaches the
training loop, and interpreter exit still lets pending saves finish.

The process is a fresh interpreter (``python -c``, :func:`serve`) with the
trainer's environment and ``sys.path`` -- not multiprocessing's spawn,
which would re-run a training script that has no ``if __name__ ==
"__main__"`` guard. A planner is pickled to it with each save; one that
does not pickle (a class defined inside a function) fails that save on
every rank, naming why.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import warnings
import weakref
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # torch's stub does not re-export it
from torch.distributed.distributed_c10d import PrefixStore

from dcpstore._impl.dcp.failures import describe_failure, save_error
from dcpstore._impl.dcp.liveness.retried_cleanups import Leftovers, with_leftovers
from dcpstore._impl.dcp.writer import save_state_dict
from dcpstore._impl.engines.engine import SaveJob
from dcpstore._impl.engines.shared_memory import Slab, map_bytes
from dcpstore._impl.engines.staging import SharedState
from dcpstore._impl.storage import open_storage
from dcpstore._impl.storage.backend_registry import registered_backends, restore_backends
from dcpstore._impl.util.distributed import is_distributed
from dcpstore._impl.util.errors import SaveError
from dcpstore._impl.values.options import SaveOptions
from dcpstore._impl.values.results import SaveStats

log = logging.getLogger(__name__)

#: How long a checkpoint process may take to start and join its group
#: when the saver sets no collective timeout.
START_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class _Hello:
    """What a new checkpoint process is told first."""

    sys_path: list[str]
    rank: int
    world: int
    #: (host, port, key prefix) of the TCPStore its group meets at; None: no group.
    rendezvous: tuple[str, int, str] | None
    timeout_s: float


@dataclass(frozen=True)
class _Job:
    """One save, for the checkpoint process."""

    env: dict[str, str]
    uri: str
    #: The save's options, but its process group (the process has its own).
    options: SaveOptions
    workers: int
    state: SharedState
    #: Slabs the trainer still holds: the process forgets the others' mappings.
    live_slabs: frozenset[int]
    #: The backends the trainer registered (scheme -> "module:Class").
    backends: dict[str, str]
    commit_files: dict[str, bytes]


class ProcessEngine:
    """:class:`~dcpstore._impl.engines.engine.Engine` ``"process"`` (see the module docstring)."""

    name: ClassVar[str] = "process"
    shared_staging: ClassVar[bool] = True

    def __init__(self, collective_timeout: timedelta | None) -> None:
        self.timeout = collective_timeout or START_TIMEOUT
        #: Per background group (id; 0: no group): its checkpoint process.
        self._workers: dict[int, _Worker] = {}
        #: Per background group: where its processes meet, and how often they have.
        self._rendezvous: dict[int, tuple[str, int]] = {}
        self._starts: dict[int, int] = {}
        #: Rank 0's stores, served from this process for as long as the engine lives.
        self._stores: list[Any] = []

    @classmethod
    def unavailable(cls) -> str | None:
        if not hasattr(socket, "send_fds"):  # pragma: no cover - non-POSIX
            return "it needs a POSIX system (file descriptors passed over sockets)"
        return None

    @classmethod
    def target_problem(cls, backend: str, uri: str) -> str | None:
        if uri.partition("://")[0] == "memory":
            return "memory:// lives in this process's memory, where a checkpoint process cannot write; pass engine='native'"
        return None

    def save(self, job: SaveJob) -> SaveStats:
        worker = self._worker(job.group)
        outcome = worker.run(job)
        stats = _agree(outcome, job, worker)
        job.progress.update(stats.bytes_written)  # the checkpoint process reports its bytes at the end
        return stats

    def close(self) -> None:
        workers, self._workers = list(self._workers.values()), {}
        for worker in workers:
            worker.stop()
        self._stores = []

    # -- the checkpoint processes ----------------------------------------------
    def _worker(self, group: dist.ProcessGroup | None) -> _Worker:
        """This rank's checkpoint process for ``group``, alive on every rank
        (collective on ``group``): where any rank's is gone, every rank
        starts a new one."""
        key = id(group) if group is not None else 0
        worker = self._workers.get(key)
        alive = worker is not None and worker.alive()
        if group is not None:
            votes = torch.tensor([int(alive)], dtype=torch.int32)
            dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
            alive = bool(votes[0])
        if alive and worker is not None:
            return worker
        if worker is not None:
            worker.stop()
        rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
        rendezvous = None
        if group is not None:
            host, port = self._meeting_point(key, rank, group)
            self._starts[key] = self._starts.get(key, 0) + 1
            rendezvous = (host, port, f"dcpstore-checkpoint/{self._starts[key]}/")
        hello = _Hello(list(sys.path), rank, world, rendezvous, self.timeout.total_seconds())
        worker = self._workers[key] = _Worker.start(hello)
        return worker

    def _meeting_point(self, key: int, rank: int, group: dist.ProcessGroup) -> tuple[str, int]:
        """(host, port) of the store the group's checkpoint processes meet
        at: served by rank 0's trainer, made once (collective on ``group``)."""
        found = self._rendezvous.get(key)
        if found is not None:
            return found
        point: list[Any] = [None]
        if rank == 0:
            store = TCPStore("0.0.0.0", 0, None, is_master=True, wait_for_workers=False, timeout=self.timeout)
            self._stores.append(store)
            global_rank_0 = dist.get_global_rank(group, 0) == 0 if is_distributed() else True
            host = os.environ.get("MASTER_ADDR") if global_rank_0 else None
            point[0] = (host or socket.getfqdn(), store.port)
        dist.broadcast_object_list(point, src=dist.get_global_rank(group, 0), group=group)
        self._rendezvous[key] = point[0]
        return self._rendezvous[key]


class _Worker:
    """The trainer's side of one checkpoint process."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket, rank: int) -> None:
        self.proc = proc
        self.sock = sock
        self.conn = Connection(os.dup(sock.fileno()))
        self.rank = rank
        #: Slabs whose descriptor the process has (id -> the slab, while this process holds it).
        self.slabs: dict[int, weakref.ref[Slab]] = {}
        self.broken = False

    @classmethod
    def start(cls, hello: _Hello) -> _Worker:
        """Start a checkpoint process and wait until it has joined its group."""
        mine, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _ENTRY, str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env=_child_env(),
            )
        except OSError as e:
            mine.close()
            raise SaveError(f"rank {hello.rank}: cannot start a checkpoint process ({sys.executable}): {e}") from e
        finally:
            theirs.close()
        worker = cls(proc, mine, hello.rank)
        try:
            worker.conn.send(hello)
            if not worker.conn.poll(hello.timeout_s + 60):
                raise SaveError(f"no answer in {hello.timeout_s + 60:g} s")
            reply = worker.conn.recv()
            if reply[0] != "ready":
                raise SaveError(reply[1])
        except (OSError, EOFError, SaveError) as e:
            why = worker.death() if worker.proc.poll() is not None or isinstance(e, (OSError, EOFError)) else str(e)
            worker.stop()
            raise SaveError(f"rank {hello.rank}: the checkpoint process did not start: {why}") from e
        return worker

    def alive(self) -> bool:
        return not self.broken and self.proc.poll() is None

    def run(self, job: SaveJob) -> tuple[str, Any]:
        """Have the process save ``job``: ``("ok", SaveStats)``,
        ``("failed", exception)`` or ``("died", how)``. Every save reaches
        the process, a job it cannot be sent as a refusal, so that every
        rank's process votes before any starts writing."""
        o = job.options
        state = job.staged.shared
        slab = job.staged.slab
        try:
            if state is None or slab is None:
                raise SaveError("the state was not staged in shared memory")
            self.slabs = {k: ref for k, ref in self.slabs.items() if ref() is not None}
            live = frozenset({*self.slabs, slab.id})
            message = pickle.dumps(
                _Job(
                    dict(os.environ),
                    job.storage.url.uri,
                    dataclasses.replace(o, process_group=None),
                    job.workers,
                    state,
                    live,
                    registered_backends(),
                    dict(job.commit_files),
                ),
                protocol=pickle.HIGHEST_PROTOCOL,
            )
        except Exception as e:  # e.g. a planner that does not pickle: refused on every rank
            return self._exchange(("refused", f"{type(e).__name__}: {e}"), None, e)
        return self._exchange(("job", message), None if slab.id in self.slabs else slab, None)

    def _exchange(self, message: tuple[str, Any], slab: Slab | None, error: BaseException | None) -> tuple[str, Any]:
        try:
            if slab is not None:
                self.conn.send(("slab", slab.id, slab.nbytes))
                socket.send_fds(self.sock, [b"F"], [slab.fd])
                self.slabs[slab.id] = weakref.ref(slab)
            self.conn.send(message)
            reply = self.conn.recv()
        except (OSError, EOFError):
            self.broken = True
            return ("died", self.death())
        if reply[0] == "ok":
            return ("ok", reply[1])
        if error is None:
            error = _remote_error(reply[1], reply[2])
        return ("failed", error)

    def death(self) -> str:
        """How the process ended (waits for it briefly)."""
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return f"pid {self.proc.pid} stopped answering"
        if code < 0:
            return f"pid {self.proc.pid}, killed by {signal.Signals(-code).name}"
        return f"pid {self.proc.pid}, exit status {code}"

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the process to leave; kill it if it does not (a save it still
        runs then fails)."""
        self.broken = True
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()
        self.sock.close()


def _child_env() -> dict[str, str]:
    """The trainer's environment, with this dcpstore first on the path (it
    may have been found through a ``sys.path`` entry the environment lacks;
    the process takes the trainer's whole ``sys.path`` once started)."""
    env = dict(os.environ)
    here = os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    )  # above dcpstore/: this is dcpstore/_impl/engines/process.py
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


def _remote_error(blob: bytes | None, description: str) -> BaseException:
    """The checkpoint process's exception (pickled by our own child: as
    trusted as this process), or a SaveError carrying its description."""
    if blob is not None:
        try:
            error = pickle.loads(blob)
            if isinstance(error, BaseException):
                return error
        except Exception:  # an exception type that does not unpickle
            pass
    return SaveError(description)


def _agree(outcome: tuple[str, Any], job: SaveJob, worker: _Worker) -> SaveStats:
    """Every rank's outcome, agreed on ``job.group``: this rank's stats, or
    raise (on every rank when any failed). After a failure every rank's
    checkpoint process is replaced at the next save: a peer's failure may
    have left its group unusable."""
    kind, value = outcome
    died = kind == "died"
    any_failed, any_died = kind != "ok", died
    if job.group is not None:
        flags = torch.tensor([int(kind != "ok"), int(died)], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=job.group)
        any_failed, any_died = bool(flags[0]), bool(flags[1])
    if not any_failed:
        stats: SaveStats = value
        return stats
    worker.broken = True
    mine = value if kind == "failed" else None
    if any_died:
        deaths: list[Any] = [(worker.rank, value) if died else None]
        if job.group is not None:
            deaths = [None] * dist.get_world_size(job.group)
            dist.all_gather_object(deaths, (worker.rank, value) if died else None, group=job.group)
        which = ", ".join(f"rank {rank}: {how}" for rank, how in (d for d in deaths if d is not None))
        raise SaveError(
            f"async save to {job.storage.uri} failed: its checkpoint process died ({which}); nothing of this "
            "save was committed unless its .metadata landed (dcpstore ls shows it); the next save starts a new "
            "checkpoint process on every rank"
        ) from mine
    if mine is None:
        raise SaveError(f"async save to {job.storage.uri} failed on another rank")
    raise mine


# ---------------------------------------------------------------------------
# The checkpoint process
# ---------------------------------------------------------------------------


#: The checkpoint process's command (``python -c``: this module is imported
#: under its own name, not run as ``__main__``).
_ENTRY = "import sys; from dcpstore._impl.engines.process import serve; serve(int(sys.argv[1]), int(sys.argv[2]))"


def serve(fd: int, parent: int) -> None:
    """The checkpoint process: serve the trainer ``parent`` over the socket ``fd``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training loop's
    _die_with(parent)
    sock = socket.socket(fileno=fd)
    conn = Connection(os.dup(fd))
    hello: _Hello = conn.recv()
    sys.path[:] = hello.sys_path
    grouped = hello.rendezvous is not None
    try:
        if hello.rendezvous is not None:
            host, port, prefix = hello.rendezvous
            timeout = timedelta(seconds=hello.timeout_s)
            store = PrefixStore(prefix, TCPStore(host, port, None, is_master=False, timeout=timeout))
            dist.init_process_group("gloo", store=store, rank=hello.rank, world_size=hello.world, timeout=timeout)
    except Exception as e:
        conn.send(("failed", describe_failure(e)))
        return
    conn.send(("ready", os.getpid()))
    blocks: dict[int, torch.Tensor] = {}
    leftovers = Leftovers()  # clean-ups of failed saves the storage refused: tried again, as a saver does
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:  # the trainer is gone
                return
            if message[0] == "stop":
                return
            if message[0] == "slab":
                _, slab_id, nbytes = message
                _, fds, _, _ = socket.recv_fds(sock, 1, 1)
                blocks[slab_id] = map_bytes(fds[0], nbytes)
                os.close(fds[0])
                continue
            leftovers.retry_in_background()
            reply = _save(message, blocks, grouped, leftovers)
            conn.send(reply)
            if grouped and reply[0] != "ok":
                # Leave at once. gloo tells only the ranks that talk to a
                # dead peer directly: on more than two ranks the others
                # would wait in the collective for its timeout. Closing our
                # connections fails theirs too, rank by rank, and the
                # trainers start every rank's process anew after a failure
                # anyway.
                return
    finally:
        if grouped and is_distributed():
            dist.destroy_process_group()  # first: a leftover's retry may take the storage's timeouts
        leftovers.finish("as a checkpoint process stopped")


def _save(
    message: tuple[str, Any], blocks: dict[int, torch.Tensor], grouped: bool, leftovers: Leftovers
) -> tuple[Any, ...]:
    """One save in the checkpoint process: ``("ok", SaveStats)`` or
    ``("failed", pickled exception or None, description)``; the clean-ups
    a failed save could not do are kept in ``leftovers``, and its error
    says so (:func:`~dcpstore._impl.dcp.liveness.retried_cleanups.with_leftovers`)."""
    job: _Job | None = None
    error: BaseException | None = None
    try:
        if message[0] != "job":
            raise SaveError(f"the trainer could not send this save to its checkpoint process: {message[1]}")
        job = pickle.loads(message[1])
        if job.env != os.environ:
            os.environ.clear()
            os.environ.update(job.env)
        for gone in set(blocks) - job.live_slabs:
            del blocks[gone]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a DeviceMesh unpickled away from its groups says so, harmlessly
            state = job.state.rebuild(blocks[job.state.slab_id])
    except BaseException as e:
        error = e
    try:
        if grouped:  # every rank ready, or none starts: nobody waits for a rank that cannot
            votes = torch.tensor([int(error is not None)], dtype=torch.int32)
            dist.all_reduce(votes, op=dist.ReduceOp.MAX)
            if error is None and bool(votes[0]):
                error = SaveError("not started: another rank's checkpoint process could not start this save")
        if error is None and job is not None:
            restore_backends(job.backends)
            storage = open_storage(job.uri, storage_options=job.options.storage_options)
            try:
                stats = save_state_dict(
                    state, storage, job.options, workers=job.workers, process_group=None, commit_files=job.commit_files
                )
                return ("ok", stats)
            except BaseException as e:
                plain = save_error(e, storage.uri, "async save")
                kept = with_leftovers(plain, storage, leftovers)
                error = e if kept is plain else kept  # the error as it is, unless it must say what is left
            finally:
                storage.close()
    except BaseException as e:  # a peer gone mid-collective too: the trainer hears of it, and restarts us
        error = e
    assert error is not None
    try:
        blob: bytes | None = pickle.dumps(error)
    except Exception:
        blob = None
    return ("failed", blob, describe_failure(error))


def _die_with(parent: int) -> None:
    """Be killed when the trainer goes (Linux: ``PR_SET_PDEATHSIG``); leave
    now if it has gone already."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)
