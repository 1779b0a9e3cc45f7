"""`zerojax launch`: start the processes of one multi-process run and watch over them.

    zerojax launch -n 2 train.py --config configs/zero3.yaml
    zerojax launch --hostfile hosts --dry-run train.py --config configs/zero3.yaml

Locally it starts N processes of the script with a free coordinator port in `ZEROJAX_*` variables
(which `zerojax.runtime.distributed.start` reads), prefixes every output line with `[i]`, forwards
signals, and - the point of a launcher - never leaves a run hanging: when one process fails it
stops the others (SIGTERM, then SIGKILL after `--grace` seconds) and exits non-zero, naming the
process and why. With a DeepSpeed hostfile (`host slots=N` lines) it runs one process per host
over ssh, or prints the per-host commands.

The launcher never starts JAX (no device is touched here): it only starts and watches processes.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Sequence

from zerojax.runtime.watchdog import ENV_HANG_TIMEOUT, EXIT_HUNG, REPORT_PREFIX
from zerojax.runtime.distributed import (ENV_COORDINATOR, ENV_DEVICES_PER_PROCESS, ENV_LOCAL_RANK, ENV_LOCAL_SIZE, ENV_NUM_PROCESSES, ENV_PROCESS_ID)

_LINE_END = re.compile(rb"(?<=[\r\n])")
# gloo's per-connection chatter (one line per rank and mesh group at start-up): not the program's output
_GLOO_CONNECTED = re.compile(rb"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks")
DEFAULT_MASTER_PORT = 29500  # DeepSpeed's default, used when ports on other hosts cannot be probed
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


class LaunchError(ValueError):
    """Bad launcher arguments or hostfile; the message says what to write instead."""


# ---------------------------------------------------------------------------------------------
# Arguments, hostfile, commands.

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zerojax launch",
        description="Start N processes of a training script joined through jax.distributed.",
        epilog="Example: zerojax launch -n 2 train.py --config configs/zero3.yaml")
    p.add_argument("-n", "--num-processes", type=int, default=None,
                   help="processes to start on this machine (default: 1, or one per hostfile host)")
    p.add_argument("--devices-per-process", type=int, default=None, metavar="K",
                   help="devices each process drives: K virtual CPU devices on a CPU machine, local "
                        "accelerators [r*K, (r+1)*K) for local process r (default: the config's "
                        "mesh.cpu_devices split evenly; on a multi-GPU host give K)")
    p.add_argument("--hostfile", type=Path, default=None,
                   help="DeepSpeed hostfile ('host slots=N' per line): one process per host over ssh")
    p.add_argument("--master-addr", default=None,
                   help="coordinator host (default: 127.0.0.1, or the hostfile's first host)")
    p.add_argument("--master-port", type=_port, default=None,
                   help=f"coordinator port (default: a free port locally, {DEFAULT_MASTER_PORT} with a hostfile)")
    p.add_argument("--grace", type=float, default=5.0, metavar="SECONDS",
                   help="after a failure, seconds between SIGTERM and SIGKILL of the other processes")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="stop every process and fail after this many seconds")
    p.add_argument("--hang-timeout", type=float, default=None, metavar="SECONDS",
                   help="every process fails, dumping its Python stack, after this many seconds without "
                        "progress (sets ZEROJAX_HANG_TIMEOUT, overriding distributed.hang_timeout; 0: off)")
    p.add_argument("--dry-run", action="store_true", help="print the per-process commands and exit")
    p.add_argument("-m", "--module", action="store_true", help="run the target as `python -m module`")
    p.add_argument("--no-python", action="store_true", help="run the target as a program, not a Python script")
    p.add_argument("target", help="the training script (e.g. train.py)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def _port(text: str) -> int:
    """A TCP port (1..65535), or argparse's one-line error naming the flag."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port; give a number from 1 to 65535, e.g. "
                                         f"{DEFAULT_MASTER_PORT}")
    return int(text)


# A host as ssh and the coordinator address take it: a name or IPv4 address, `user@` allowed, an IPv6
# address in brackets. Nothing that starts with '-' (ssh would read an option, e.g. -oProxyCommand=...)
# and no shell or space characters (the dry run prints the name into shell lines).
_HOST = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_.+-]*@)?(?:[A-Za-z0-9_][A-Za-z0-9_.-]*|\[[0-9A-Za-z:.%_-]+\])")


def check_host(name: str, where: str) -> str:
    """`name` if it is a plain host name or address; LaunchError naming `where` otherwise."""
    if not _HOST.fullmatch(name):
        why = ("starts with '-', which ssh would read as an option" if name.startswith("-") else
               "is not a host name (letters, digits, '.', '-', '_', an optional user@, [IPv6])")
        raise LaunchError(f"{where}: host {name!r} {why}; write one plain host name per line")
    return name


@dataclass(frozen=True)
class Host:
    name: str
    slots: int | None


def read_hostfile(path: Path) -> list[Host]:
    """DeepSpeed's hostfile: `hostname slots=N` per line, `#` comments and blank lines ignored."""
    if not path.is_file():
        raise LaunchError(f"--hostfile {path}: no such file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise LaunchError(f"{path}:{line}: not UTF-8 text (byte {data[e.start]:#04x}); a hostfile holds "
                          f"'hostname slots=N' lines in plain text") from None
    hosts: list[Host] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        check_host(parts[0], f"{path}:{number}")
        slots = None
        for extra in parts[1:]:
            key, _, value = extra.partition("=")
            if key != "slots" or not value.isdigit() or int(value) < 1:
                raise LaunchError(f"{path}:{number}: expected 'hostname slots=N' with N >= 1, got {raw.strip()!r}")
            slots = int(value)
        if any(h.name == parts[0] for h in hosts):
            raise LaunchError(f"{path}:{number}: host {parts[0]} is listed twice; list each host once")
        hosts.append(Host(parts[0], slots))
    if not hosts:
        raise LaunchError(f"--hostfile {path}: no hosts in it; write one 'hostname slots=N' line per host")
    return hosts


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the coordinator binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def target_command(args: argparse.Namespace) -> list[str]:
    if args.no_python:
        return [args.target, *args.args]
    if args.module:
        return [sys.executable, "-u", "-m", args.target, *args.args]
    if not Path(args.target).exists():
        raise LaunchError(f"{args.target}: no such script (use -m for a module, --no-python for a program)")
    return [sys.executable, "-u", args.target, *args.args]


@dataclass
class Spec:
    """One process to start: where, what, with which environment additions."""
    index: int
    host: str | None          # None: this machine
    command: list[str]
    env: dict[str, str]

    def line(self) -> str:
        """The command as one shell line, as it runs on its host (same working directory)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"cd {shlex.quote(os.getcwd())} && env {env} {shlex.join(self.command)}"

    def shell(self) -> str:
        """What to type on this machine to start it (over ssh for another host)."""
        return self.line() if self.host is None else shlex.join(["ssh", "--", self.host, self.line()])

    def guarded(self, grace: float) -> str:
        """The remote side of an ssh launch: the command, stopped when the ssh connection's stdin
        closes - the launcher closes it to stop the run, and it closes by itself when the launcher or
        its ssh client dies - with SIGTERM, then SIGKILL after `grace` seconds. Killing the local ssh
        client alone would leave the remote process running. Under `sh -c`, whatever the login shell."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        script = "\n".join([
            f"cd {shlex.quote(os.getcwd())} || exit 1",
            "exec 3<&0",
            f"env {env} {shlex.join(self.command)} 3<&- &",
            "pid=$!",
            "{ while read -r _ <&3; do :; done; kill -TERM $pid; "
            f"sleep {max(grace, 0.1):g}; kill -KILL $pid; }} 2>/dev/null &",
            "guard=$!",
            "exec 3<&-",
            "wait $pid; rc=$?",
            "kill $guard 2>/dev/null",
            "exit $rc"])
        return f"sh -c {shlex.quote(script)}"


def process_env(index: int, n: int, coordinator: str, local_rank: int, local_size: int,
                devices: int | None) -> dict[str, str]:
    env = {ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(n), ENV_PROCESS_ID: str(index),
           ENV_LOCAL_RANK: str(local_rank), ENV_LOCAL_SIZE: str(local_size), "PYTHONUNBUFFERED": "1"}
    if devices is not None:
        env[ENV_DEVICES_PER_PROCESS] = str(devices)
    return env


def _with_hang_timeout(specs: list[Spec], seconds: float | None) -> list[Spec]:
    if seconds is None:
        return specs
    if seconds < 0:
        raise LaunchError(f"--hang-timeout {seconds:g}: must be >= 0 seconds (0: off)")
    for spec in specs:
        spec.env[ENV_HANG_TIMEOUT] = f"{seconds:g}"
    return specs


def plan_processes(args: argparse.Namespace) -> list[Spec]:
    """The processes to start, from -n (this machine) or a hostfile (one per host)."""
    return _with_hang_timeout(_plan(args), getattr(args, "hang_timeout", None))


def _plan(args: argparse.Namespace) -> list[Spec]:
    command = target_command(args)
    if args.devices_per_process is not None and args.devices_per_process < 1:
        raise LaunchError(f"--devices-per-process {args.devices_per_process}: must be at least 1")
    if args.hostfile is not None:
        hosts = read_hostfile(args.hostfile)
        if args.num_processes is not None and args.num_processes != len(hosts):
            raise LaunchError(f"-n {args.num_processes} contradicts the hostfile's {len(hosts)} hosts "
                              f"(one process per host); drop -n")
        addr = check_host(args.master_addr, "--master-addr") if args.master_addr else hosts[0].name.rpartition("@")[2]
        coordinator = f"{addr}:{args.master_port or DEFAULT_MASTER_PORT}"
        return [Spec(i, h.name, command,
                     process_env(i, len(hosts), coordinator, 0, 1,
                                 args.devices_per_process if args.devices_per_process is not None else h.slots))
                for i, h in enumerate(hosts)]
    n = 1 if args.num_processes is None else args.num_processes
    if n < 1:
        raise LaunchError(f"-n {n}: must be at least 1")
    addr = check_host(args.master_addr, "--master-addr") if args.master_addr else "127.0.0.1"
    coordinator = f"{addr}:{args.master_port or free_port()}"
    return [Spec(i, None, command, process_env(i, n, coordinator, i, n, args.devices_per_process))
            for i in range(n)]


# ---------------------------------------------------------------------------------------------
# Running and watching.

def _find_prctl() -> object | None:
    """libc's prctl, resolved here in the launcher so a child runs no loader code after fork."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the launcher dies, so no process outlives it."""
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)  # type: ignore[operator]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (signal {-code})"
    return f"exited with code {code}"


def _exit_status(code: int) -> int:
    """The launcher's exit status for a failed child: its own code, or 128 + N for signal N."""
    return code if code > 0 else 128 - code


@dataclass
class Child:
    spec: Spec
    popen: subprocess.Popen
    last: collections.deque = field(default_factory=lambda: collections.deque(maxlen=5))
    hang_report: str | None = None  # its watchdog's first line, when it stopped itself as hung
    readers: list[threading.Thread] = field(default_factory=list)


class Launcher:
    """Starts the processes, copies their output with a prefix, and stops them all on the first failure."""

    def __init__(self, specs: Sequence[Spec], *, grace: float = 5.0, timeout: float | None = None,
                 out: IO[bytes] | None = None, err: IO[bytes] | None = None):
        self.specs, self.grace, self.timeout = list(specs), grace, timeout
        self.out = out or sys.stdout.buffer
        self.err = err or sys.stderr.buffer
        self.children: list[Child] = []
        self._lock = threading.Lock()
        self._signals: list[int] = []

    # -- output ---------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        with self._lock:
            self.err.write(f"zerojax launch: {text}\n".encode())
            self.err.flush()

    def _copy(self, child: Child, stream: IO[bytes], sink: IO[bytes]) -> None:
        """Copy `stream` line by line (\\n or \\r, so progress bars keep working) with the prefix."""
        prefix = f"[{child.spec.index}] ".encode()
        pending = b""
        fd = stream.fileno()
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            *lines, pending = _LINE_END.split(pending + chunk)  # each line keeps its \n or \r
            if lines:
                with self._lock:
                    for line in lines:
                        text = line.strip()
                        if _GLOO_CONNECTED.match(text):
                            continue
                        # a bare \r or \n (a progress bar redrawing) gets no prefix of its own
                        sink.write(prefix + line if text else line)
                        if text:
                            child.last.append(text.decode(errors="replace"))
                            if text.startswith(REPORT_PREFIX.encode()) and child.hang_report is None:
                                child.hang_report = text.decode(errors="replace")
                    sink.flush()
        if pending:
            with self._lock:
                sink.write(prefix + pending + b"\n")
                sink.flush()
                child.last.append(pending.strip().decode(errors="replace"))
        stream.close()

    # -- processes ------------------------------------------------------------------------------
    def _start(self, spec: Spec) -> Child:
        env = {**os.environ, **spec.env}
        # `--`: nothing from a hostfile is ever read as an ssh option (check_host refuses those too).
        command = spec.command if spec.host is None else ["ssh", "--", spec.host, spec.guarded(self.grace)]
        # Its own process group: signals reach it once, from the launcher, not also from the terminal.
        # A remote process's stdin is a pipe the launcher holds open: closing it stops the process.
        popen = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                 stdin=subprocess.DEVNULL if spec.host is None else subprocess.PIPE,
                                 stderr=subprocess.PIPE, process_group=0,
                                 preexec_fn=_die_with_parent if _PRCTL is not None else None)
        child = Child(spec, popen)
        for stream, sink in ((popen.stdout, self.out), (popen.stderr, self.err)):
            t = threading.Thread(target=self._copy, args=(child, stream, sink), daemon=True,
                                 name=f"zerojax-launch-copy-{spec.index}")
            t.start()
            child.readers.append(t)
        return child

    def _signal(self, child: Child, sig: int) -> None:
        if child.popen.poll() is None:
            try:
                os.killpg(child.popen.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    @staticmethod
    def _hang_up(child: Child) -> None:
        if child.popen.stdin is not None and not child.popen.stdin.closed:
            try:
                child.popen.stdin.close()
            except OSError:
                pass

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals.append(signum)

    def stop(self, survivors: Sequence[Child], first: int = signal.SIGTERM) -> None:
        """`first` to every running process, SIGKILL to those still running after the grace period;
        a remote process is stopped from its host (see Spec.guarded) when its ssh stdin closes."""
        for child in survivors:
            self._hang_up(child)
            self._signal(child, first)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and any(c.popen.poll() is None for c in survivors):
            time.sleep(0.05)
        for child in survivors:
            if child.popen.poll() is None:
                self._signal(child, signal.SIGKILL)
        for child in survivors:
            child.popen.wait()

    def _finish(self) -> None:
        for child in self.children:
            self._hang_up(child)
            for t in child.readers:
                t.join(timeout=5)

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in FORWARDED}
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run(self) -> int:
        started = time.monotonic()
        try:
            for spec in self.specs:
                self.children.append(self._start(spec))
        except OSError as e:
            self.say(f"could not start process {len(self.children)}: {e}")
            self.stop(self.children)
            return 1
        interrupted: int | None = None
        while True:
            while self._signals:
                sig = self._signals.pop(0)
                if interrupted is not None and sig in (signal.SIGINT, signal.SIGTERM):
                    self.say(f"second {signal.Signals(sig).name}: killing every process")
                    self.stop(self.children, signal.SIGKILL)
                    self._finish()
                    return 128 + interrupted
                if sig in (signal.SIGINT, signal.SIGTERM):
                    interrupted = sig
                    self.say(f"{signal.Signals(sig).name}: forwarded to every process (send it again to kill them)")
                for child in self.children:
                    self._signal(child, sig)
            codes = [c.popen.poll() for c in self.children]
            stuck = any(code == EXIT_HUNG or c.hang_report for c, code in zip(self.children, codes)
                        if code not in (None, 0))
            if all(code is not None for code in codes) and not (stuck and interrupted is None):
                self._finish()
                if interrupted is not None:
                    return 128 + interrupted
                bad = [(c, code) for c, code in zip(self.children, codes) if code != 0]
                if bad:
                    child, code = bad[0]
                    self.say(self._failure(child, code))
                    return _exit_status(code)
                return 0
            failed = [(c, code) for c, code in zip(self.children, codes) if code not in (None, 0)]
            if failed and interrupted is None and any(code == EXIT_HUNG or c.hang_report for c, code in failed):
                return self._hung()
            if failed and interrupted is None:
                child, code = failed[0]
                running = [c for c in self.children if c.popen.poll() is None]
                self.say(self._failure(child, code)
                         + (f"; stopping process(es) {[c.spec.index for c in running]} (SIGTERM, SIGKILL after "
                            f"{self.grace:g} s)" if running else ""))
                self.stop(running)
                self._finish()
                return _exit_status(code)
            if self.timeout is not None and time.monotonic() - started > self.timeout:
                running = [c for c in self.children if c.popen.poll() is None]
                self.say(f"--timeout {self.timeout:g} s reached; stopping process(es) {[c.spec.index for c in running]}")
                self.stop(running)
                self._finish()
                return 124
            time.sleep(0.05)

    def _hung(self) -> int:
        """A process stopped itself as hung: the others, stuck with it, report within their own
        timeout (give them `grace` + a little to do so); name every stuck process, stop the rest. A
        process that reported counts as stuck however it ended: the first to exit can take the others
        down through the coordination service before they exit by themselves."""
        deadline = time.monotonic() + self.grace + 2.0
        while time.monotonic() < deadline and any(c.popen.poll() is None for c in self.children):
            time.sleep(0.05)
        for child in self.children:  # let the copy threads pass on the stacks already written
            if child.popen.poll() is not None:
                for t in child.readers:
                    t.join(timeout=2)
        hung = [c for c in self.children if c.popen.poll() == EXIT_HUNG or c.hang_report]
        running = [c for c in self.children if c.popen.poll() is None]
        lines = [f"process(es) {[c.spec.index for c in hung]} made no progress within the hang timeout and "
                 f"stopped (their Python stacks are above):"]
        lines += [f"  [{c.spec.index}] pid {c.popen.pid}{f' on {c.spec.host}' if c.spec.host else ''}: "
                  f"{(c.hang_report or '(no report)')[len(REPORT_PREFIX):].strip()}" for c in hung]
        if running:
            lines.append(f"stopping process(es) {[c.spec.index for c in running]} (SIGTERM, SIGKILL after "
                         f"{self.grace:g} s)")
        self.say("\n".join(lines))
        self.stop(running)
        self._finish()
        return EXIT_HUNG

    def _failure(self, child: Child, code: int) -> str:
        where = f" on {child.spec.host}" if child.spec.host else ""
        text = f"process {child.spec.index} (pid {child.popen.pid}{where}) {describe_exit(code)}"
        if child.last:
            text += f"; its last output: {child.last[-1]!r}"
        return text


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        specs = plan_processes(args)
    except LaunchError as e:
        print(f"zerojax launch: error: {e}", file=sys.stderr)
        return 2
    remote = any(s.host is not None for s in specs)
    if args.dry_run or (remote and shutil.which("ssh") is None):
        if not args.dry_run:
            print("zerojax launch: ssh is not available here; run these commands on the hosts yourself:",
                  file=sys.stderr)
        for spec in specs:
            print(spec.shell())
        return 0 if args.dry_run else 1
    return Launcher(specs, grace=args.grace, timeout=args.timeout).run()


if __name__ == "__main__":
    sys.exit(main())
