"""``dcpstore bench URI``: measure save and load at a URI, honestly.

Owns the measuring harness that ships in the wheel, so a user can time
dcpstore on their own storage:

* :mod:`.measure` -- the state dict, peak RSS, page-cache dropping, timers;
* :mod:`.runner`  -- :class:`Entry` (one row: a way to save and load the
  state), :func:`measure_all` / :func:`run_entry` (interleaved repeats,
  missing dependencies become ``skipped`` records, wrong data a failure),
  :func:`summarize`;
* :mod:`.entries` -- the dcpstore entry over any URI;
* :mod:`.limits`  -- the limit rows (raw threads on files, raw boto3 swept
  over connections and part sizes), the best of them and ratios against it;
* :mod:`.report`  -- the text table, the JSON file, the plot;
* :mod:`.interference` -- what a background save costs a training loop
  (``dcpstore bench URI --interference``: :func:`interference`).

:func:`bench` is what the CLI runs: one dcpstore entry per worker count.

May import: dcpstore's public API (``save``/``load``), :mod:`dcpstore.storage`,
:mod:`dcpstore._impl.util.errors`, :mod:`dcpstore._impl.util.units` and the engines' choice
(which engine can save where, so that a row that cannot is skipped); torch, tqdm, and (late,
only where used) psutil and matplotlib. Never ``benchmarks/`` and never the
CLI: the peer comparisons in ``benchmarks/`` build on this package (their
peers and hardware limits are more :class:`Entry` subclasses), not the
other way round.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import uuid
from collections.abc import Collection, Sequence
from typing import Any

from tqdm import tqdm

from dcpstore._impl.bench.entries import DcpstoreEntry, TieredEntry
from dcpstore._impl.bench.interference import DEFAULT_ROW, DcpstoreRow, StepWork, describe, measure
from dcpstore._impl.bench.limits import RawFiles, s3_sweep
from dcpstore._impl.bench.measure import make_state, parse_int_list, zeros_like_state
from dcpstore._impl.bench.runner import (
    RECORD_KEYS,
    Entry,
    Record,
    SaveOutcome,
    Skip,
    Waiter,
    done,
    measure_all,
    run_entry,
    summarize,
)
from dcpstore._impl.storage import join_uri, parse_uri
from dcpstore._impl.util.units import human_bytes, parse_size
from dcpstore._impl.values.options import AUTO, ENGINES

__all__ = [
    "RECORD_KEYS",
    "Entry",
    "Record",
    "SaveOutcome",
    "Skip",
    "Waiter",
    "bench",
    "done",
    "interference",
    "limit_entries",
    "human_bytes",
    "make_state",
    "measure_all",
    "parse_int_list",
    "parse_size",
    "run_entry",
    "run_entries",
    "summarize",
    "zeros_like_state",
]


def _line(rec: Record) -> str:
    if rec.status != "ok":
        return f"  {rec.name}: {rec.status}: {rec.reason}"
    read = f", load {rec.read_gbps:.3f} GB/s" if rec.read_gbps is not None else ""
    return (
        f"  {rec.name} #{rec.repeat + 1}: save {rec.write_gbps:.3f} GB/s{read}, "
        f"blocked {rec.blocked_s:.3f} s, peak RSS {human_bytes(rec.peak_rss_bytes or 0)}"
    )


def run_entries(
    entries: Sequence[Entry],
    state: dict[str, Any],
    dest: dict[str, Any],
    *,
    repeat: int = 1,
    drop_caches: bool = True,
    verify: bool = True,
    progress: bool = True,
    desc: str = "bench",
    rss_ignore_pids: Collection[int] = (),
) -> list[Record]:
    """Measure the entries (interleaved, see :func:`measure_all`) under one
    progress bar on stderr; a line per measurement is printed above the bar."""
    with tqdm(
        total=len(entries) * repeat, desc=desc, unit="run", file=sys.stderr, disable=not progress, leave=False
    ) as bar:

        def on_record(rec: Record) -> None:
            # A skipped or failed entry will not run its remaining repeats.
            bar.update(1 if rec.status == "ok" else repeat - rec.repeat)
            bar.set_postfix_str(rec.name)
            if progress:
                tqdm.write(_line(rec), file=sys.stderr)

        records = measure_all(
            entries,
            state,
            dest,
            repeat=repeat,
            drop_caches=drop_caches,
            verify=verify,
            on_record=on_record,
            rss_ignore_pids=rss_ignore_pids,
        )
    return records


def bench(
    uri: str,
    *,
    size: int,
    tensors: int,
    workers: Sequence[int],
    engine: str = "auto",
    async_: bool = False,
    repeat: int = 1,
    enable_msc: bool = False,
    drop_caches: bool = False,
    progress: bool = True,
    tiered: str | None = None,
    limit: bool = False,
) -> list[Record]:
    """Save and load ``size`` bytes in ``tensors`` tensors at ``uri`` once per
    worker count (``repeat`` times each) and return the records.

    ``tiered=LOCAL_DIR``: per worker count, three async entries side by side:
    a plain save to ``LOCAL_DIR`` (the local baseline), a tiered manager
    (local commit, then replication to ``uri``) and a direct save to ``uri``
    (the durable baseline).

    ``limit``: also measure the storage's limit rows first (see
    :func:`limit_entries`), so that the table shows each row against them.

    ``drop_caches``: drop the page cache before each local load (root only;
    it empties the whole host's cache, so it is never done unasked). Each
    record's ``cold_read`` says whether it was (:func:`.report.cache_note`)."""
    url = parse_uri(uri)
    created_root = url.scheme == "file" and not os.path.exists(url.path)
    state = make_state(size, tensors)
    dest = zeros_like_state(state)
    run_id = f"dcpstore-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    entries: list[Entry] = list(limit_entries(uri, run_id, size, workers, enable_msc=enable_msc)) if limit else []
    for w in workers:
        if tiered is None:
            entries.append(DcpstoreEntry(uri, run_id, workers=w, engine=engine, async_=async_, enable_msc=enable_msc))
            continue
        entries += [
            DcpstoreEntry(tiered, run_id, workers=w, engine=engine, async_=True, name=f"local async/{engine} w={w}"),
            TieredEntry(uri, tiered, run_id, workers=w, engine=engine, enable_msc=enable_msc),
            DcpstoreEntry(
                uri,
                run_id,
                workers=w,
                engine=engine,
                async_=True,
                enable_msc=enable_msc,
                name=f"direct async/{engine} w={w}",
            ),
        ]
    try:
        return run_entries(entries, state, dest, repeat=repeat, drop_caches=drop_caches, progress=progress)
    finally:
        if url.scheme == "file":  # leave nothing behind (directories only if empty)
            for path in (
                (os.path.join(url.path, run_id), url.path) if created_root else (os.path.join(url.path, run_id),)
            ):
                with contextlib.suppress(OSError):
                    os.rmdir(path)


def interference(
    uri: str,
    *,
    size: int,
    tensors: int,
    repeat: int = 3,
    engines: Sequence[str] = (*ENGINES, AUTO),
    enable_msc: bool = False,
    step_ops: int = 200,
    progress: bool = True,
) -> tuple[str, list[Any]]:
    """Lost step-seconds and GIL time of one async save per engine at ``uri``
    (see :mod:`.interference`), ``"auto"`` among them (the default, on
    whichever engine it chooses here): a description of the setup and the
    :class:`~.interference.Result` per engine (an engine that cannot write
    ``uri`` is a ``skipped`` result saying why)."""
    url = parse_uri(uri)
    created_root = url.scheme == "file" and not os.path.exists(url.path)
    state = make_state(size, tensors)
    step = StepWork(step_ops)
    run_id = f"dcpstore-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    rows = [
        DcpstoreRow(
            DEFAULT_ROW if engine == AUTO else f"dcpstore {engine}",
            join_uri(uri, run_id, engine),
            url.scheme,
            engine=engine,
            executor="process" if engine == "process" else "threads",
            enable_msc=enable_msc,
        )
        for engine in engines
    ]

    def say(result: Any) -> None:
        if progress:
            print(f"  {result.name}: {result.status}", file=sys.stderr, flush=True)

    try:
        return describe(step, size, repeat, None), measure(rows, state, step, repeat=repeat, on_result=say)
    finally:
        if url.scheme == "file":  # this run's directory, and the root if the run made it
            shutil.rmtree(os.path.join(url.path, run_id), ignore_errors=True)
            if created_root:
                with contextlib.suppress(OSError):
                    os.rmdir(url.path)


def limit_entries(uri: str, run_id: str, size: int, workers: Sequence[int], *, enable_msc: bool = False) -> list[Entry]:
    """The limit rows for the storage at ``uri``: a local path gets raw threads
    writing and reading plain files at each worker count; ``s3://`` (without
    MSC) raw boto3 swept over connections and part sizes, endpoint and
    credentials from the standard AWS sources. Other backends have none
    (an entry that says so). Everything goes under ``<uri>/<run_id>``."""
    url = parse_uri(uri)
    if url.scheme == "file" and not enable_msc:
        return [RawFiles(os.path.join(url.path, run_id), w) for w in workers]
    if url.scheme == "s3" and not enable_msc:
        prefix = "/".join(p for p in (url.path.strip("/"), run_id) if p)
        return list(s3_sweep(None, url.netloc, size, prefix=prefix))
    return [
        _NoLimit(
            f"no limit rows for {url.scheme}://{' through MSC' if enable_msc else ''}: "
            "only local paths and native s3:// have a raw client to measure"
        )
    ]


class _NoLimit(Entry):
    """A row that only says why no limit was measured."""

    group = "limit"
    name = "limit"

    def __init__(self, why: str) -> None:
        self.why = why

    def setup(self, state: dict[str, Any]) -> None:
        raise Skip(self.why)

    def save(self, state: dict[str, Any]) -> Waiter:
        raise Skip(self.why)
