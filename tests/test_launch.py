"""`zerojax launch`: prefixes, environment, failure handling, signals, hostfiles.

Most children here are tiny Python programs (no JAX), so these run in about a second each; one
test kills a real jax.distributed process. Every subprocess has a timeout.
"""
from __future__ import annotations

import io
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from zerojax.runtime import launch
from zerojax.runtime.launch import Launcher, LaunchError, _parser, plan_processes, read_hostfile

ROOT = Path(__file__).resolve().parents[1]
CACHE = os.path.abspath(os.environ.get("ZEROJAX_TEST_CACHE", ROOT / ".cache" / "jax"))


def env() -> dict[str, str]:
    out = {**os.environ, "JAX_PLATFORMS": "cpu", "ZEROJAX_TEST_CACHE": CACHE, "PYTHONPATH": str(ROOT)}
    out.pop("XLA_FLAGS", None)
    return out


def launch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "zerojax.cli", "launch", *args]


def child(tmp_path: Path, code: str, name: str = "child.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return str(path)


def run(*args: str, timeout: float = 60, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`zerojax launch` as a user runs it (a subprocess; it pays the ~2 s import of zerojax)."""
    return subprocess.run(launch_cmd(*args), cwd=ROOT, env={**env(), **(extra_env or {})}, capture_output=True,
                          text=True, timeout=timeout)


def run_here(*args: str, monkeypatch: pytest.MonkeyPatch) -> subprocess.CompletedProcess:
    """The launcher in this process (the children are still real processes), for speed.

    Without the parent-death hook: it runs Python in the forked child, which JAX (live in this
    process) warns about; test_processes_do_not_outlive_a_killed_launcher covers it in a real launcher.
    """
    monkeypatch.setattr(launch, "_PRCTL", None)
    for key, value in env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(ROOT)
    out, err = io.BytesIO(), io.BytesIO()
    parsed = _parser().parse_args(list(args))
    code = Launcher(plan_processes(parsed), grace=parsed.grace, timeout=parsed.timeout, out=out, err=err).run()
    return subprocess.CompletedProcess(args, code, out.getvalue().decode(), err.getvalue().decode())


class Lines:
    """Lines of a running process's stdout, read in a thread, so a test can wait with a deadline."""

    def __init__(self, proc: subprocess.Popen):
        self.q: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.reader = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self.reader.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.q.put(line)

    def wait_for(self, predicate, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        while not predicate(self.seen):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out; output so far:\n{''.join(self.seen)[-3000:]}")
            try:
                self.seen.append(self.q.get(timeout=left))
            except queue.Empty:
                pass
        return self.seen

    def text(self, timeout: float = 30) -> str:
        """Everything the process wrote, once it has closed its output."""
        self.reader.join(timeout)
        while not self.q.empty():
            self.seen.append(self.q.get())
        return "".join(self.seen)


def test_each_process_gets_its_place_and_a_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = child(tmp_path, """
        import os, sys
        e = os.environ
        print("id", e["ZEROJAX_PROCESS_ID"], "of", e["ZEROJAX_NUM_PROCESSES"], "at", e["ZEROJAX_COORDINATOR_ADDRESS"],
              "local", e["ZEROJAX_LOCAL_RANK"], e["ZEROJAX_LOCAL_SIZE"], "devices", e["ZEROJAX_DEVICES_PER_PROCESS"])
        print("to stderr", file=sys.stderr)
        sys.stdout.write("no newline at the end")
    """)
    proc = run_here("-n", "3", "--devices-per-process", "2", script, monkeypatch=monkeypatch)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    coordinators = set()
    for i in range(3):
        line = next(l for l in out if l.startswith(f"[{i}] id "))
        _, _, pid, _, n, _, coord, _, rank, size, _, devices = line.split()
        assert (pid, n, rank, size, devices) == (str(i), "3", str(i), "3", "2")
        coordinators.add(coord)
        assert f"[{i}] no newline at the end" in out
        assert f"[{i}] to stderr" in proc.stderr.splitlines()
    assert len(coordinators) == 1 and coordinators.pop().startswith("127.0.0.1:")


def test_a_failure_stops_the_others_and_names_the_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = child(tmp_path, """
        import os, signal, sys, time
        if os.environ["ZEROJAX_PROCESS_ID"] == "1":
            time.sleep(0.5)
            print("boom: out of memory", file=sys.stderr, flush=True)
            sys.exit(3)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stuck process: needs SIGKILL
        print("working", flush=True)
        time.sleep(300)
    """)
    t = time.monotonic()
    proc = run_here("-n", "2", "--grace", "1", script, monkeypatch=monkeypatch)
    assert time.monotonic() - t < 30
    assert proc.returncode == 3
    assert "[0] working" in proc.stdout
    assert "zerojax launch: process 1 (pid" in proc.stderr
    assert "exited with code 3; its last output: 'boom: out of memory'; stopping process(es) [0]" in proc.stderr


def test_a_killed_process_is_reported_with_its_signal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = child(tmp_path, """
        import os, signal, time
        if os.environ["ZEROJAX_PROCESS_ID"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(300)
    """)
    proc = run_here("-n", "2", script, monkeypatch=monkeypatch)
    assert proc.returncode == 128 + signal.SIGKILL
    assert "process 0 (pid" in proc.stderr and "was killed by SIGKILL (signal 9)" in proc.stderr


def test_signals_are_forwarded_once(tmp_path: Path) -> None:
    script = child(tmp_path, """
        import signal, sys, time
        got = []
        signal.signal(signal.SIGUSR1, lambda s, f: print("got SIGUSR1", flush=True))
        signal.signal(signal.SIGINT, lambda s, f: got.append(s))
        print("ready", flush=True)
        deadline = time.time() + 60
        while not got and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        print("got SIGINT", len(got), flush=True)
        sys.exit(130)
    """)
    proc = subprocess.Popen(launch_cmd("-n", "2", script), cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = Lines(proc)
        lines.wait_for(lambda seen: sum("ready" in l for l in seen) == 2, 30)
        proc.send_signal(signal.SIGUSR1)
        lines.wait_for(lambda seen: sum("got SIGUSR1" in l for l in seen) == 2, 30)
        proc.send_signal(signal.SIGINT)
        seen = lines.wait_for(lambda seen: sum("got SIGINT" in l for l in seen) == 2, 30)
        assert proc.wait(timeout=30) == 130
    finally:
        proc.kill()
    assert {l.strip() for l in seen if "got SIGINT" in l} == {"[0] got SIGINT 1", "[1] got SIGINT 1"}


def test_timeout_stops_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = child(tmp_path, "import time; time.sleep(300)\n")
    proc = run_here("-n", "2", "--timeout", "1", "--grace", "1", script, monkeypatch=monkeypatch)
    assert proc.returncode == 124 and "--timeout 1 s reached" in proc.stderr


def test_bad_arguments_are_one_clear_error(tmp_path: Path) -> None:
    proc = run("-n", "2", "no_such_script.py")
    assert proc.returncode == 2 and "no_such_script.py: no such script" in proc.stderr
    proc = run("-n", "0", child(tmp_path, "pass\n"))
    assert proc.returncode == 2 and "-n 0: must be at least 1" in proc.stderr


# ------------------------------------------------------------------------------------------------
# Hostfiles.

def test_hostfile_parsing(tmp_path: Path) -> None:
    good = tmp_path / "hosts"
    good.write_text("# two nodes\nworker-0 slots=8\n\nworker-1 slots=4  # smaller\nworker-2\n")
    assert [(h.name, h.slots) for h in read_hostfile(good)] == [("worker-0", 8), ("worker-1", 4), ("worker-2", None)]
    for text, match in [("a slots=two\n", "expected 'hostname slots=N'"), ("a slots=1\na slots=2\n", "listed twice"),
                        ("# nothing\n", "no hosts")]:
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(LaunchError, match=match):
            read_hostfile(bad)


def test_hostfile_dry_run_prints_one_ssh_command_per_host(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=8\nnode-b slots=8\n")
    proc = run("--hostfile", str(hosts), "--dry-run", "train.py", "--config", "configs/zero3.yaml")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2
    for i, (line, host) in enumerate(zip(lines, ["node-a", "node-b"])):
        assert line.startswith(f"ssh -- {host} ")
        for part in ("ZEROJAX_COORDINATOR_ADDRESS=node-a:29500", "ZEROJAX_NUM_PROCESSES=2",
                     f"ZEROJAX_PROCESS_ID={i}", "ZEROJAX_DEVICES_PER_PROCESS=8", "train.py --config configs/zero3.yaml"):
            assert part in line


FAKE_SSH = f"""#!{sys.executable}
# A stand-in ssh: `ssh -- HOST COMMAND` runs COMMAND here, in its own session like a process on
# another machine (signals to this client never reach it), with this client's stdin.
import subprocess, sys
args = sys.argv[1:]
assert args[0] == "--", args  # the launcher always ends ssh's options before the host
print("ssh to", args[1], file=sys.stderr, flush=True)
sys.exit(subprocess.call(["sh", "-c", args[2]], start_new_session=True))
"""


def fake_ssh(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ssh"
    fake.write_text(FAKE_SSH)
    fake.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_hostfile_runs_over_ssh(tmp_path: Path) -> None:
    """A stand-in `ssh` that runs the remote command here: the launcher's ssh path end to end."""
    hosts = tmp_path / "hosts"
    hosts.write_text("alpha slots=1\nbeta slots=1\n")
    script = child(tmp_path, 'import os; print("process", os.environ["ZEROJAX_PROCESS_ID"], os.getcwd())\n')
    proc = run("--hostfile", str(hosts), script, extra_env=fake_ssh(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert f"[0] process 0 {ROOT}" in proc.stdout and f"[1] process 1 {ROOT}" in proc.stdout
    assert "[0] ssh to alpha" in proc.stderr and "[1] ssh to beta" in proc.stderr


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_stopping_the_launch_stops_remote_processes(tmp_path: Path) -> None:
    """Killing an ssh client leaves its remote process running; the launcher's remote side stops it."""
    hosts = tmp_path / "hosts"
    hosts.write_text("alpha slots=1\nbeta slots=1\n")
    pids = tmp_path / "pids"
    script = child(tmp_path, f"""
        import os, time
        with open({str(pids)!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        print("running", flush=True)
        time.sleep(600)
    """)
    proc = run("--hostfile", str(hosts), "--timeout", "4", "--grace", "1", script, extra_env=fake_ssh(tmp_path))
    assert proc.returncode == 124, proc.stderr
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in started), f"remote processes {started} outlived the launch"


@pytest.mark.parametrize("line, match", [
    ("-oProxyCommand=touch${IFS}/tmp/pwned slots=1", "starts with '-'"),
    ("-p2222", "starts with '-'"),
    ("node;touch${IFS}x slots=1", "is not a host name"),
    ("$(touch x) slots=1", "is not a host name"),
    ("`id` slots=1", "is not a host name"),
    ("node|cat slots=1", "is not a host name"),
    ("'quoted' slots=1", "is not a host name"),
])
def test_hostile_hostfile_lines_are_refused(tmp_path: Path, line: str, match: str) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(f"good-node slots=1\n{line}\n")
    with pytest.raises(LaunchError, match=f"{hosts}:2: host .* {match}"):
        read_hostfile(hosts)
    # Through the command line: one error, exit 2, and ssh is never run.
    proc = run("--hostfile", str(hosts), "tests/multiprocess_worker.py", extra_env=fake_ssh(tmp_path))
    assert proc.returncode == 2 and f"{hosts}:2" in proc.stderr and "ssh to" not in proc.stderr, proc.stderr
    assert not (ROOT / "x").exists() and not Path("/tmp/pwned").exists()


def test_plain_host_names_and_addresses_are_accepted(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("node-1.cluster.local slots=8\nuser@10.0.0.2 slots=8\n[fe80::1%eth0]\nworker_3\n")
    assert [h.name for h in read_hostfile(hosts)] == ["node-1.cluster.local", "user@10.0.0.2", "[fe80::1%eth0]",
                                                     "worker_3"]
    parsed = _parser().parse_args(["--hostfile", str(hosts), "train.py"])
    assert plan_processes(parsed)[0].env["ZEROJAX_COORDINATOR_ADDRESS"] == "node-1.cluster.local:29500"


def test_non_utf8_hostfile_and_bad_port_are_one_clear_error(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_bytes(b"node-a slots=1\nnode-\xff slots=1\n")
    with pytest.raises(LaunchError, match=f"{hosts}:2: not UTF-8 text"):
        read_hostfile(hosts)
    hosts.write_text("node-a slots=1\n")
    for port in ("abc", "0", "70000", "-1"):
        proc = run("--hostfile", str(hosts), "--master-port", port, "--dry-run", "train.py")
        assert proc.returncode == 2 and "--master-port" in proc.stderr and "1 to 65535" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    proc = run("--master-addr=-oProxyCommand=x", "--dry-run", "-n", "2", "train.py")
    assert proc.returncode == 2 and "--master-addr: host" in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------------------------
# A real jax.distributed run losing a process.

def test_killing_one_jax_process_fails_the_launch_within_a_minute() -> None:
    proc = subprocess.Popen(launch_cmd("-n", "2", "tests/multiprocess_worker.py", "hang"), cwd=ROOT, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = Lines(proc)
        seen = lines.wait_for(lambda seen: sum("ready pid" in l for l in seen) == 2, 120)
        victim = int(next(l for l in seen if l.startswith("[1] ready pid")).split()[-1])
        t = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        code = proc.wait(timeout=60)
        elapsed = time.monotonic() - t
        print(f"launcher exited {elapsed:.1f} s after the kill")
    finally:
        proc.kill()
    stderr = proc.stderr.read()
    assert code != 0 and elapsed < 60, (code, elapsed)
    assert f"process 1 (pid {victim}) was killed by SIGKILL" in stderr, stderr[-3000:]


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for a reaper counts: it runs no more)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
def test_processes_do_not_outlive_a_killed_launcher(tmp_path: Path) -> None:
    script = child(tmp_path, 'import os, time\nprint("pid", os.getpid(), flush=True)\ntime.sleep(120)\n')
    proc = subprocess.Popen(launch_cmd("-n", "2", script), cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        seen = Lines(proc).wait_for(lambda seen: sum("pid" in l for l in seen) == 2, 30)
        pids = [int(l.split()[-1]) for l in seen if " pid " in l]
        proc.kill()  # SIGKILL: the launcher cannot clean up itself
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        proc.kill()
    assert all(_gone(p) for p in pids), pids
