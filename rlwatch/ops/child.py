"""The command ``rlwatch run`` starts: signals passed on, the command awaited, its status as a shell
reports it.

- **Ctrl-C never kills the trainer mid-checkpoint.** The terminal sends Ctrl-C (SIGINT), Ctrl-\\
  (SIGQUIT) and a hangup (SIGHUP) to its whole foreground process group, the command included: those
  reach the command once, from the terminal, and are not sent again (a second SIGINT would interrupt
  the trainer's own ``except KeyboardInterrupt`` checkpoint). The same signals sent by another
  process (``kill``, a scheduler), and SIGTERM, SIGUSR1, SIGUSR2 from anywhere, are passed on to
  the command. ``rlwatch run`` then waits for the command however long it takes; a second Ctrl-C
  stops it at once (SIGKILL).
- **A signal sent to the whole process group reaches the command once.** ``timeout``, Slurm,
  systemd and ``kill -INT -PGID`` signal every process of ``rlwatch run``'s group. When ``rlwatch
  run`` is not the terminal's foreground job (no terminal, or started by ``timeout``), the command
  runs in its own process group, so such a signal reaches it only as ``rlwatch run`` passes it on;
  and the same signal from the same sender twice within :data:`DUPLICATE_S` (``timeout`` signals
  its child, then its group) is passed on once.
- **No orphan.** SIGTERM to ``rlwatch run`` is passed on and awaited; on Linux the command also gets
  SIGTERM if ``rlwatch run`` itself dies (even by SIGKILL).
- **Exit status**: the command's; 128 + N when signal N ended it (130 after Ctrl-C, 143 after
  SIGTERM), as a shell reports it. No traceback.

Linux tells a terminal's signal from another process's (``sigtimedwait``'s ``si_code``); where that
is not available, a SIGINT/SIGQUIT/SIGHUP is taken as the terminal's when ``rlwatch run`` runs in the
terminal's foreground, else passed on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

#: Signals passed on to the command (when they did not already reach it from the terminal).
FORWARDED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
                  if hasattr(signal, name))
#: Signals a terminal sends to its whole foreground process group (the command got them too).
TERMINAL_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGQUIT", "SIGHUP") if hasattr(signal, name))
_SI_KERNEL = 0x80                      # siginfo si_code of a signal the kernel (the terminal) generated
#: Seconds within which the same signal from the same sending process is one signal, passed on once.
DUPLICATE_S = 1.0


def exit_status(returncode: int) -> int:
    """A shell's exit status for a ``subprocess`` return code: 128 + N for a command signal N ended."""
    return 128 - returncode if returncode < 0 else returncode


def run_command(command: Sequence[str], env: dict[str, str], say: Callable[[str], None]) -> int:
    """Run ``command`` with ``env`` until it exits, passing signals on (module docstring); its exit
    status. ``say`` prints one line to the user. Raises OSError when the command cannot start."""
    if os.name != "posix" or threading.current_thread() is not threading.main_thread():
        return _run_plain(command, env)
    if hasattr(signal, "sigtimedwait"):
        return _Supervisor(command, env, say).run()
    return _run_with_handlers(command, env, say)


class _Supervisor:
    """Linux (and every POSIX with ``sigtimedwait``): the forwarded signals are blocked in this
    thread and read one by one with their sender, so none interrupts Python here."""

    def __init__(self, command: Sequence[str], env: dict[str, str], say: Callable[[str], None]) -> None:
        self.command, self.env, self.say = command, env, say
        self.interrupts = 0
        self.last_sent: dict[tuple[int, int], float] = {}        # (signal, sender PID) -> when

    def run(self) -> int:
        watched = (*FORWARDED, signal.SIGCHLD)
        before = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
        try:
            child = subprocess.Popen(self.command, env=self.env,
                                     preexec_fn=_child_setup(before, own_group=not _in_foreground()))
            while child.poll() is None:
                info = signal.sigtimedwait(watched, 0.5)
                if info is not None and info.si_signo != signal.SIGCHLD and child.poll() is None:
                    from_terminal = info.si_code == _SI_KERNEL
                    if from_terminal or not self.duplicate(info.si_signo, info.si_pid):
                        self.handle(child, info.si_signo, from_terminal=from_terminal)
            return exit_status(child.returncode)
        finally:
            while signal.sigtimedwait(watched, 0) is not None:   # those that came after the command ended
                pass
            signal.pthread_sigmask(signal.SIG_SETMASK, before)

    def duplicate(self, signum: int, sender: int) -> bool:
        """Whether ``signum`` from process ``sender`` repeats one it sent within :data:`DUPLICATE_S`."""
        now = time.monotonic()
        last = self.last_sent.get((signum, sender))
        self.last_sent[(signum, sender)] = now
        return sender > 0 and last is not None and now - last < DUPLICATE_S

    def handle(self, child: subprocess.Popen, signum: int, from_terminal: bool) -> None:
        """Pass ``signum`` on unless the terminal already sent it to the command; a second SIGINT kills."""
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                self.say("rlwatch run: stopping the command now (SIGKILL)")
                child.kill()
                return
            self.say("rlwatch run: waiting for the command to finish (Ctrl-C again stops it at once)")
        if not (from_terminal and signum in TERMINAL_SIGNALS and _same_group(child.pid)):
            try:
                child.send_signal(signum)
            except ProcessLookupError:
                pass


def _same_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == os.getpgrp()
    except OSError:
        return False


def _child_setup(mask: set, own_group: bool = False) -> Callable[[], None]:
    """What the command's process does before exec: its own process group when ``own_group``, the
    signal mask rlwatch run had, and (Linux) a SIGTERM when rlwatch run dies, so that it never runs
    on as an orphan."""
    parent = os.getpid()

    def setup() -> None:
        if own_group:
            os.setpgid(0, 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))    # PR_SET_PDEATHSIG
            except (OSError, AttributeError):
                pass
            if os.getppid() != parent:          # rlwatch run died before prctl took effect
                os.kill(os.getpid(), signal.SIGTERM)
    return setup


def _run_with_handlers(command: Sequence[str], env: dict[str, str], say: Callable[[str], None]) -> int:
    """POSIX without ``sigtimedwait`` (macOS): Python handlers, the terminal's signals told apart by
    whether rlwatch run is in the terminal's foreground process group."""
    supervisor = _Supervisor(command, env, say)
    child = None
    pending: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        if child is None:
            pending.append(signum)
        else:
            supervisor.handle(child, signum, from_terminal=_in_foreground())

    previous = {signum: signal.signal(signum, on_signal) for signum in FORWARDED}
    try:
        child = subprocess.Popen(command, env=env)
        for signum in pending:
            supervisor.handle(child, signum, from_terminal=_in_foreground())
        while True:
            try:
                return exit_status(child.wait())
            except InterruptedError:
                continue
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _in_foreground() -> bool:
    for stream in (sys.stdin, sys.stderr, sys.stdout):
        try:
            return os.tcgetpgrp(stream.fileno()) == os.getpgrp()
        except (OSError, AttributeError, ValueError):
            continue
    return False


def _run_plain(command: Sequence[str], env: dict[str, str]) -> int:
    """Windows (a console's Ctrl-C reaches every process attached to it), or a caller off the main
    thread: wait for the command, an interrupt here does not stop the waiting."""
    child = subprocess.Popen(command, env=env)
    while True:
        try:
            return exit_status(child.wait())
        except KeyboardInterrupt:
            continue


__all__ = ["run_command", "exit_status", "FORWARDED"]
