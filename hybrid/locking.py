"""Safe first use of runs/ by several processes started at once (two replicas, two tuners, a tuner and a run).

Whatever is created once and then shared (a generated checkpoint, the MLflow and tuner sqlite stores) is created
under a file lock beside it (`<path>.lock`, an flock through the `filelock` package): the first process creates it,
the others wait and then reuse it. Files each process writes for itself (benchmark records, traces) get names no
other process can take (`unique_path`); Hydra's run directory carries the process id (conf/config.yaml).
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional
from urllib.parse import unquote


@contextmanager
def locked(path: Path, what: str) -> Iterator[None]:
    """Hold the lock of `path` (the file `<path>.lock`, its folder created); while another process holds it, say
    once on stderr that this one waits for it (`what`: what that process is doing, e.g. "generating ...")."""
    from filelock import FileLock, Timeout

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"waiting for another process {what} (lock {lock.lock_file})", file=sys.stderr, flush=True)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def sqlite_file(url: str) -> Optional[Path]:
    """The database file of a sqlite URL (`sqlite:///relative`, `sqlite:////absolute`); None for a server's URL or
    an in-memory database."""
    scheme, _, rest = url.partition("://")
    if not scheme.startswith("sqlite") or not rest.startswith("/"):
        return None
    path = unquote(rest[1:].split("?", 1)[0])
    return Path(path) if path not in ("", ":memory:") else None


def unique_path(directory: Path, stem: str, suffix: str) -> Path:
    """`directory/<stem><suffix>`, else `<stem>-2<suffix>`, `-3`, ...: created empty here (O_EXCL), so no other
    process writing into `directory` at the same moment gets the same name."""
    directory.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        path = directory / f"{stem}{'' if n == 1 else f'-{n}'}{suffix}"
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return path
        except FileExistsError:
            n += 1


def write_atomic(path: Path, text: str) -> None:
    """Replace `path`'s contents at once: a reader sees the old text or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
