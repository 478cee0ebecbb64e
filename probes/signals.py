"""SIGTERM: a job stopped by its scheduler ends its run saying so, and still dies of SIGTERM.

Schedulers stop jobs with SIGTERM (a preemption, a time limit, ``scancel``, a pod's eviction, torchrun
taking its workers down, ``kill``). By default the process dies at once: the probe's sender thread dies
with it, and so do the events it had not sent yet (up to ``flush_interval`` of them, everything while the
server was away) and the run's end, so the run turns 'stale' instead of 'ended'.

At the first attach, in the main thread, and only while SIGTERM has its default action (a job's own
handler is never replaced), the probe installs a handler that closes the open probes (``close`` with
the reason ``killed by SIGTERM``, at most ``FLUSH_S`` seconds: what is not delivered by then is spooled)
and then lets SIGTERM do what it does by default: the process dies of it, with the same exit status.

A Python handler runs only when the main thread is back in the interpreter. A job busy in one long C
call (a huge operator, a hung collective) would then not die until its scheduler's SIGKILL, where it
used to die at once. So the signal also wakes a watchdog thread (``signal.set_wakeup_fd``: the C-level
handler writes the signal's number to a pipe at once): if the handler has not started within
``WATCHDOG_S`` seconds, the watchdog closes the probes itself and ends the process with status 143
(128 + SIGTERM, what a shell reports for a process killed by SIGTERM). When the job (or asyncio) already
uses the wakeup fd, there is no watchdog and the handler alone does the work. A forked child (a
DataLoader worker) drops the wakeup fd: a signal to the child is not the parent's. When another library
later installs its own handler and calls ours from it (Lightning composes the handlers it finds, and its
SLURM auto-requeue keeps the job running through SIGTERM), ours only flushes the probes: whether the
process ends is that handler's decision.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Callable

log = logging.getLogger("traindx.probe")

# Seconds the probes have to deliver what they hold before the process dies.
FLUSH_S = 5.0
# Seconds the watchdog gives the main thread to start the handler before it does the work itself.
WATCHDOG_S = 2.0

_close: Callable[[str, float], None] | None = None  # closes the open probes of this process
_flush: Callable[[float], None] | None = None  # sends what they hold, leaving them open
_installed = False
_lock = threading.Lock()
_started = threading.Event()  # a SIGTERM is being handled: the process is on its way out
_pipe: tuple[int, int] | None = None
# Probe.step() calls in progress in this thread (the main one, where the handler runs), and whether a
# SIGTERM came during one: it is delivered when the step ends (see Probe.step).
stepping = 0
pending = False


def install(close: Callable[[str, float], None], flush: Callable[[float], None]) -> None:
    """Handle SIGTERM from now on (see the module docstring), when it is ours to handle: POSIX, the main
    thread, and SIGTERM still at its default action. Called at every attach; installs once."""
    global _close, _flush, _installed
    _close, _flush = close, flush
    if _installed or os.name != "posix" or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the job handles SIGTERM itself (or ignores it): its choice stands
        signal.signal(signal.SIGTERM, _handler)
    except (ValueError, OSError):  # not the main interpreter, or signals unavailable
        return
    _installed = True
    _start_watchdog()


def _start_watchdog() -> None:
    global _pipe
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(r), os.close(w)
        return
    if previous != -1:  # someone's (asyncio's) wakeup fd: give it back, and go without a watchdog
        signal.set_wakeup_fd(previous)
        os.close(r), os.close(w)
        return
    _pipe = (r, w)
    os.register_at_fork(after_in_child=_forget_in_child)
    threading.Thread(target=_watch, args=(r,), name="traindx-sigterm", daemon=True).start()


def _forget_in_child() -> None:
    """In a forked child: stop writing the child's signals into the parent's pipe."""
    global _pipe
    if _pipe is None:
        return
    try:
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):  # forked from a thread other than the main one
        pass
    for fd in _pipe:
        try:
            os.close(fd)
        except OSError:
            pass
    _pipe = None


def _watch(r: int) -> None:
    while True:
        try:
            data = os.read(r, 64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGTERM in data:
            if signal.getsignal(signal.SIGTERM) is not _handler:
                continue  # another library's handler decides now (see _handler)
            if not _started.wait(WATCHDOG_S) and _claim():
                _close_probes()
                os._exit(128 + signal.SIGTERM)
            return


def _claim() -> bool:
    """True for the one of the handler and the watchdog that closes the probes."""
    with _lock:
        if _started.is_set():
            return False
        _started.set()
        return True


def _close_probes() -> None:
    close = _close
    if close is not None:
        try:
            close("killed by SIGTERM", FLUSH_S)
        except Exception:  # noqa: BLE001 - the process is ending whatever happens here
            log.warning("traindx: could not close the probes on SIGTERM", exc_info=True)


def _handler(signum: int, frame: object) -> None:
    global pending
    if signal.getsignal(signum) is not _handler:
        # Installed since by another library that calls ours as part of its own (Lightning composes the
        # handlers it finds): whether the process ends is its decision (its SLURM requeue keeps the job
        # running). Deliver what the probes hold, and leave them open.
        if _flush is not None:
            try:
                _flush(FLUSH_S)
            except Exception:  # noqa: BLE001 - inside someone else's signal handler
                log.warning("traindx: could not flush the probes on SIGTERM", exc_info=True)
        return
    if stepping:  # inside probe.step(): finish the step first (it calls deliver() on its way out)
        pending = True
        return
    deliver()


def deliver() -> None:
    """Close the probes and die of SIGTERM: in the handler, or at the end of the step it interrupted."""
    global pending
    pending = False
    signum = signal.SIGTERM
    try:
        signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        main = True
    except ValueError:  # the step that was interrupted runs in another thread: it cannot touch handlers
        main = False
    if _claim():
        _close_probes()
    else:  # the watchdog got there first (the main thread was busy): it ends the process when done
        time.sleep(FLUSH_S + 1.0)
    if not main:
        os._exit(128 + signum)
    os.kill(os.getpid(), signum)  # what SIGTERM does by default: the process dies of it
