"""Where rendered lines are written: a JSONL file, stderr, or nowhere.

The file sink is opened on the first line, without following a symlink and without blocking
(a FIFO at the path must not hang the program), must be a regular file, is appended with one
``os.write`` per line, or per held group of whole lines (``O_APPEND``: several processes can
share it; see :meth:`FileSink.hold`) and is rotated to ``path.1`` at ``max_bytes``. A sink that
fails warns once, reports the failure (``on_failure``: the public API traces it) and stays off;
the program continues. :func:`path_problem` says, without opening anything, why a path would
not work.

structlog calls a sink's method named after the level with the rendered bytes (the file sink:
with the event itself, which it renders when it writes it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
import threading
from collections.abc import Callable
from typing import Any, Final

from ._env import DEFAULT_MAX_BYTES, TraceConfig, warn

try:  # at import, never under a sink's lock: an import while holding a lock can deadlock
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

#: ``on_failure(path, reason)``: called once, outside the sink's lock, when a file sink fails
OnFailure = Callable[[str, str], None]

_O_NOFOLLOW: Final = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK: Final = getattr(os, "O_NONBLOCK", 0)
_OPEN_FLAGS: Final = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_APPEND
    | getattr(os, "O_CLOEXEC", 0)
    | _O_NOFOLLOW  # a link at the path (shared temp directories) is refused, never followed
    | _O_NONBLOCK  # a FIFO at the path must not hang the program in open()
)
#: How often (bytes written by this process) a file sink checks its file's size and identity.
_CHECK_EVERY_MAX: Final = 1024 * 1024
#: Lines a thread holds (:meth:`FileSink.hold`) are written once they are this many.
HOLD_MAX_LINES: Final = 512
_get_ident = threading.get_ident


class _Held:
    """One thread's held lines (rendered, or events still to render): how deep its holds are
    nested, the lines."""

    __slots__ = ("depth", "lines")

    def __init__(self) -> None:
        self.depth = 1
        self.lines: list[Any] = []


class _SinkRefused(OSError):
    """The path exists but is not something we write a trace into."""


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link (trace files are opened without following links)"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _wide_mode_notice(path: str, mode: int) -> str:
    return (
        f"the trace file {path!r} has permissions {stat.S_IMODE(mode):04o}, wider than 0600: "
        "other users can read it (traces name your parameters; chmod 600 it)"
    )


class FileSink:
    """Appends rendered lines (bytes) to a file: opened on the first line (mode 0600 when
    created), ``O_APPEND`` and one ``os.write`` per line (or per held group of whole lines), so
    lines from several processes never interleave. Rotated to ``path.1`` at ``max_bytes`` (see
    :meth:`_check`).
    """

    def __init__(
        self,
        path: str,
        max_bytes: int = DEFAULT_MAX_BYTES,
        on_failure: OnFailure | None = None,
        render: Callable[[Any], bytes] | None = None,
    ) -> None:
        self.path = path
        #: event dict -> its line: :meth:`write` takes events (dicts) as well as rendered lines
        #: where the pipeline gave one
        self.render = render
        self.max_bytes = max_bytes
        self.failed = False
        self.failure: str | None = None
        self._fd: int | None = None
        self._ino: tuple[int, int] | None = None
        self._warned_mode = False
        self._check_every = max(1, min(max_bytes // 16, _CHECK_EVERY_MAX)) if max_bytes else 1 << 62
        self._unchecked = 0  # bytes written since the last size/identity check
        #: a notice for the user, found under the lock and given after releasing it
        self._notice: str | None = None
        self._on_failure = on_failure
        # Reentrant: a weakref finalizer (leaf_released) can emit from a GC run that starts
        # inside write() on this same thread. Held for the file's own operations only: never
        # while warning, emitting or importing (any of those can wait for another thread).
        self._lock = threading.RLock()
        #: thread ident -> the lines it holds (:meth:`hold`); empty when none does
        self._held: dict[int, _Held] = {}

    def after_fork_in_child(self) -> None:
        """A fresh lock: the parent's may have been held by a thread the child does not have.
        The lines held at the fork are the parent's to write."""
        self._lock = threading.RLock()
        self._held = {}

    # -- held lines ------------------------------------------------------------------------------

    def hold(self) -> None:
        """Keep this thread's lines until the matching :meth:`release`, then render the events
        among them and write them all with one ``os.write`` (earlier once they are
        :data:`HOLD_MAX_LINES`). Holds nest. The patch holds around one outermost op of a
        propagating mode and one armed backward call: the events of a conversion of many
        parameters, or of every leaf a backward reaches, cost one system call instead of one
        each, are rendered in one tight loop, and appear in the file when that op or call
        ends."""
        ident = _get_ident()
        held = self._held.get(ident)
        if held is None:
            self._held[ident] = _Held()
        else:
            held.depth += 1

    def release(self) -> None:
        """End one :meth:`hold` of this thread; the outermost one writes what it kept."""
        ident = _get_ident()
        held = self._held.get(ident)
        if held is None:
            return  # held before a fork (the parent writes those lines)
        held.depth -= 1
        if held.depth <= 0:
            del self._held[ident]
            if held.lines:
                self._write_lines(held.lines)

    def write(self, data: Any) -> None:
        """One line (bytes), or one event (a dict of plain data) to render as one."""
        if not data:
            return  # an event the sink does not want (the pipeline rendered nothing)
        if self._held:
            held = self._held.get(_get_ident())
            if held is not None:
                lines = held.lines
                lines.append(data)
                if len(lines) >= HOLD_MAX_LINES:
                    held.lines = []
                    self._write_lines(lines)
                return
        if type(data) is not bytes:
            data = self._render(data)
        self._write_now(data)

    def _render(self, event: Any) -> bytes:
        render = self.render
        if render is None:
            raise TypeError("this sink was given an event but has no renderer")
        return render(event)

    def _write_lines(self, lines: list[Any]) -> None:
        render = self._render
        self._write_now(b"".join([d if type(d) is bytes else render(d) for d in lines]))

    def _write_now(self, data: bytes) -> None:
        try:
            with self._lock:
                if self.failed:
                    return
                if self._fd is None:
                    self._open()
                fd = self._fd
                assert fd is not None
                written = os.write(fd, data)
                while written < len(data):  # only on a nearly full disk: finish the line
                    written += os.write(fd, data[written:])
                self._unchecked += written
                if self._unchecked >= self._check_every:
                    self._check()
        except OSError as exc:
            self._fail(exc)
        if self._notice is not None:
            notice, self._notice = self._notice, None
            if notice is not None:
                warn(notice)

    def _open(self) -> None:
        try:
            fd = os.open(self.path, _OPEN_FLAGS, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP and _O_NOFOLLOW:
                raise _SinkRefused(exc.errno, f"{self.path!r} is {_kind(stat.S_IFLNK)}") from exc
            if exc.errno == errno.ENXIO:  # O_NONBLOCK open of a FIFO nobody reads
                raise _SinkRefused(exc.errno, f"{self.path!r} is {_kind(stat.S_IFIFO)}") from exc
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _SinkRefused(errno.EINVAL, f"{self.path!r} is {_kind(st.st_mode)}")
            if _O_NONBLOCK:
                with contextlib.suppress(OSError, AttributeError):
                    os.set_blocking(fd, True)  # a regular file: plain blocking writes
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._ino = (st.st_dev, st.st_ino)
        if stat.S_IMODE(st.st_mode) & 0o077 and not self._warned_mode:
            self._warned_mode = True  # warned by write(), after releasing the lock
            notice = _wide_mode_notice(self.path, st.st_mode)
            self._notice = f"fakegrad_patch: {notice}; appending to it."
        self._unchecked = 0
        if self.max_bytes and st.st_size >= self.max_bytes:
            self._check()

    def _check(self) -> None:
        """Size and identity of the file, every ``_check_every`` bytes this process wrote.

        Another process may have rotated the file (our fd then points at ``path.1``: reopen
        ``path``), or the file is full (rotate it). Rotation holds an exclusive ``flock`` on the
        full file and renames only if ``path`` still is that file, so of several processes that
        find it full at once exactly one renames it and the others just reopen.
        """
        self._unchecked = 0
        fd = self._fd
        if fd is None or not self.max_bytes:
            return
        st = os.fstat(fd)
        if self._is_current(st) and st.st_size >= self.max_bytes:
            flock = _flock(fd)
            try:
                if self._is_current(os.fstat(fd)):
                    os.replace(self.path, self.path + ".1")
            finally:
                flock.release()
        if not self._is_current(os.fstat(fd)):
            self._fd = self._ino = None
            with contextlib.suppress(OSError):
                os.close(fd)
            self._open()

    def _is_current(self, st: os.stat_result) -> bool:
        """Is ``path`` (not following links) still the file our fd writes to?"""
        try:
            now = os.lstat(self.path)
        except FileNotFoundError:
            return False
        return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)

    def _fail(self, exc: OSError) -> None:
        with self._lock:
            if self.failed:
                return
            self.failed = True
            self.failure = exc.strerror if isinstance(exc, _SinkRefused) else str(exc)
            fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        refused = isinstance(exc, _SinkRefused)
        reason = f"refused: {exc.strerror}" if refused else f"{type(exc).__name__}: {exc}"
        warn(
            f"fakegrad_patch: cannot write the trace file {self.path!r} ({reason}); tracing to "
            "that file is disabled, the program continues (events stay in "
            "fakegrad_patch.trace.events())."
        )
        if self._on_failure is not None:
            self._on_failure(self.path, reason)

    def close(self) -> None:
        """Write the lines every thread holds so far (their holds go on), then close the file;
        a later line reopens it."""
        for entry in list(self._held.values()):
            lines, entry.lines = entry.lines, []
            if lines:
                self._write_lines(lines)
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    debug = info = warning = error = msg = write


class _Flock:
    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None and fcntl is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)


def _flock(fd: int) -> _Flock:
    """An exclusive advisory lock on ``fd``'s file (none where ``fcntl`` does not exist)."""
    if fcntl is None:  # pragma: no cover - Windows
        return _Flock(None)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        return _Flock(None)
    return _Flock(fd)


class StderrSink:
    """Writes rendered lines to the current ``sys.stderr`` (looked up per line, so pytest's
    capture and redirections see them)."""

    path = "-"
    failed = False
    failure = None

    def write(self, data: bytes) -> None:
        if not data:
            return
        stream = sys.stderr
        if stream is None:
            return
        with contextlib.suppress(Exception):
            stream.write(data.decode("utf-8", "replace"))
            stream.flush()

    def close(self) -> None:
        pass

    debug = info = warning = error = msg = write


class NullSink:
    """The logger's target when there is no sink: events end in the memory buffer/captures."""

    def write(self, data: bytes) -> None:
        pass

    debug = info = warning = error = msg = write


Sink = FileSink | StderrSink


def make_sink(
    config: TraceConfig,
    on_failure: OnFailure | None = None,
    render: Callable[[Any], bytes] | None = None,
) -> Sink | None:
    """The sink ``config.path`` asks for; nothing is opened before the first line. ``render``:
    how a file sink renders the events it is given instead of lines."""
    if config.path is None:
        return None
    if config.path == "-":
        return StderrSink()
    return FileSink(config.path, config.max_bytes, on_failure, render)


def path_problem(target: str) -> str | None:
    """Why a trace file at ``target`` (an absolute path) would not work, or a notice about it;
    ``None`` when it can be created or appended to. Never opens the path (a FIFO would block)."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return _directory_problem(target)
    except (OSError, ValueError) as exc:
        return f"impossible trace path {target!r}: {getattr(exc, 'strerror', None) or exc}"
    if not stat.S_ISREG(st.st_mode):
        return f"the trace path {target!r} is {_kind(st.st_mode)}: it will not be written"
    if not os.access(target, os.W_OK):
        return f"the trace file {target!r} is not writable"
    if stat.S_IMODE(st.st_mode) & 0o077:
        return f"notice: {_wide_mode_notice(target, st.st_mode)}"
    return None


def _directory_problem(target: str) -> str | None:
    directory = os.path.dirname(target) or "."
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        return f"the directory of the trace file {target!r} does not exist"
    except (OSError, ValueError) as exc:
        return f"impossible trace path {target!r}: {getattr(exc, 'strerror', None) or exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"impossible trace path {target!r}: {directory!r} is not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"the directory {directory!r} is not writable: {target!r} cannot be created"
    return None
