"""The code-execution sandbox contains hostile programs and runs normal ones faithfully.

Every test gets the `no_leftovers` check: after it, no process started by the sandbox survives.
Tests that need bubblewrap fail (never skip) where it is missing: the project installs it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from titanrl.envs import Sandbox, SandboxConfig, SandboxPool, SandboxUnavailableError, run_python

CONFIG = SandboxConfig()
SLEEP_60 = "import time\ntime.sleep(60)"


# --- leftover-process detection (plain /proc, no psutil) ---------------------------------
def _stat(pid: str) -> tuple[int, int] | None:
    """(ppid, real uid) of a process, or None if it vanished or is a dead zombie left to init."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state, ppid_field = f.read().rsplit(b")", 1)[1].split()[:2]
        ppid = int(ppid_field)
        if state == b"Z" and ppid == 1:  # Already dead; only the host's init has yet to reap it.
            return None
        with open(f"/proc/{pid}/status") as f:
            uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
    except (OSError, StopIteration, ValueError):
        return None
    return ppid, uid


def _sandbox_like_pids() -> set[int]:
    """Descendants of this test process, processes in another PID namespace, and (when we are
    root) processes of the sandbox uid: every place a sandbox process could hide."""
    me = os.getpid()
    own_ns = os.readlink("/proc/self/ns/pid")
    parents: dict[int, int] = {}
    found: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        info = _stat(name)
        if info is None:
            continue
        parents[int(name)] = info[0]
        try:
            if os.readlink(f"/proc/{name}/ns/pid") != own_ns:
                found.add(int(name))
        except OSError:
            pass
        if os.geteuid() == 0 and info[1] == CONFIG.run_as_uid:
            found.add(int(name))
    for pid in parents:
        p = pid
        while p in parents and p > 1:
            p = parents[p]
            if p == me:
                found.add(pid)
                break
    return found


def _assert_all_gone(before: set[int]) -> None:
    deadline = time.monotonic() + 3.0
    while (left := _sandbox_like_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left behind: {left}"


@pytest.fixture(autouse=True)
def no_leftovers():
    """Fails the test if any sandbox process outlives it (after a short grace for reaping)."""
    before = _sandbox_like_pids()
    yield
    _assert_all_gone(before)


def _host_is_fine() -> None:
    assert subprocess.run(["true"], timeout=10).returncode == 0


# --- normal behaviour ---------------------------------------------------------------------
def test_bubblewrap_is_installed():
    """The project's set-up installs bubblewrap; its absence is a failure, not a skip."""
    assert shutil.which("bwrap"), "install it with: apt-get install -y bubblewrap"


def test_stdout_stderr_returncode_and_stdin():
    """A normal program's streams, exit status and stdin round-trip unchanged."""
    code = "import sys\nprint('got', sys.stdin.read().upper())\nprint('warn', file=sys.stderr)\nsys.exit(3)"
    r = run_python(code, stdin="hello")
    assert (r.stdout, r.stderr, r.returncode, r.timed_out, r.killed_reason) == ("got HELLO\n", "warn\n", 3, False, None)
    assert run_python("print(sum(range(10)))").ok


def test_syntax_error_reports_traceback():
    """Broken code yields a non-zero status and the traceback in stderr, not an exception."""
    r = run_python("def f(:\n  pass")
    assert r.returncode != 0 and "SyntaxError" in r.stderr and not r.timed_out


def test_interpreter_does_not_see_the_venv():
    """The sandbox runs the system python3 and cannot import the caller's venv packages."""
    r = run_python("import sys\nprint(sys.prefix)\nimport pytest")
    assert r.stdout.strip() == "/usr" and "ModuleNotFoundError" in r.stderr


def test_python_path_opts_in_to_host_packages():
    """`python_path` mounts a host directory read-only and makes its modules importable."""
    lib = tempfile.mkdtemp(prefix="titanrl-sandbox-lib-", dir="/var/tmp")  # /tmp is a fresh tmpfs inside.
    try:
        os.chmod(lib, 0o755)  # The sandbox runs as an unprivileged uid.
        with open(os.path.join(lib, "allowed_mod.py"), "w") as f:
            f.write("VALUE = 42\n")
        os.chmod(os.path.join(lib, "allowed_mod.py"), 0o644)
        r = run_python("import allowed_mod\nprint(allowed_mod.VALUE)", config=SandboxConfig(python_path=(lib,)))
        assert r.stdout == "42\n", r
    finally:
        shutil.rmtree(lib)


# --- resource attacks ---------------------------------------------------------------------
@pytest.mark.timeout(60)  # a hang guard only: the sandbox's own limit is what is tested
def test_infinite_loop_times_out():
    """A busy loop is killed at the wall-clock limit and reported as timed out."""
    r = run_python("while True:\n    pass", timeout_s=1.0)
    assert r.timed_out and r.killed_reason == "timeout" and r.returncode == -9


def test_process_limit_is_enforced():
    """RLIMIT_NPROC bites inside the sandbox (it would not for a root-mapped sandbox)."""
    code = (
        "import os, time\nn = 0\ntry:\n    while n < 1000:\n        if os.fork() == 0:\n"
        "            time.sleep(60)\n        n += 1\nexcept OSError:\n    pass\nprint(n)"
    )
    r = run_python(code, timeout_s=5.0)
    assert r.returncode == 0 and 0 < int(r.stdout) < CONFIG.max_processes


@pytest.mark.timeout(60)  # a hang guard only
def test_fork_bomb_is_contained():
    """A classic fork bomb ends at the timeout, every process of it is killed, the host is fine."""
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    r = run_python(bomb, timeout_s=2.0)
    assert r.timed_out and r.killed_reason == "timeout"
    _host_is_fine()


def test_memory_bomb_fails():
    """Allocating past RLIMIT_AS raises MemoryError inside; the host is unaffected."""
    cfg = SandboxConfig(memory_bytes=256 << 20)  # Smaller than the default only to keep the test fast.
    r = run_python("x = []\nwhile True:\n    x.append(bytearray(16 << 20))", config=cfg, timeout_s=5.0)
    assert r.returncode != 0 and "MemoryError" in r.stderr and not r.timed_out
    r = run_python("x = bytearray(64 << 30)")
    assert r.returncode != 0 and "MemoryError" in r.stderr
    _host_is_fine()


def test_huge_output_is_truncated():
    """An output flood is cut at max_output_bytes and the program killed."""
    cfg = SandboxConfig(max_output_bytes=10_000)
    r = run_python("while True:\n    print('x' * 1000)", config=cfg, timeout_s=5.0)
    assert r.stdout_truncated and r.killed_reason == "output_limit" and not r.timed_out
    assert len(r.stdout) == 10_000 and r.returncode == -9


def test_disk_fill_is_bounded():
    """Writing files is capped per file (RLIMIT_FSIZE: EFBIG) and in total (tmpfs size: ENOSPC)."""
    code = (
        "import errno\ntry:\n    open('big', 'wb').write(b'x' * (64 << 20))\nexcept OSError as e:\n"
        "    print(errno.errorcode[e.errno])\ntry:\n    for i in range(100):\n"
        "        open(f'f{i}', 'wb').write(b'x' * (8 << 20))\nexcept OSError as e:\n"
        "    print(errno.errorcode[e.errno], i)"
    )
    r = run_python(code, timeout_s=5.0)
    big, fill = r.stdout.splitlines()
    assert big == "EFBIG" and fill.startswith("ENOSPC ") and int(fill.split()[1]) <= CONFIG.tmpfs_bytes // (8 << 20)


# --- network ------------------------------------------------------------------------------
def test_cannot_reach_host_loopback_listener():
    """A TCP listener on the host's 127.0.0.1 is unreachable: the sandbox has its own loopback."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        r = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).send(b'hi')")
        assert r.returncode != 0 and "ConnectionRefusedError" in r.stderr
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_only_loopback_interface_exists():
    """Inside, the only network interface is the sandbox's own `lo`."""
    r = run_python("import socket\nprint([n for _, n in socket.if_nameindex()])\nprint(open('/proc/net/dev').read())")
    first, *dev = r.stdout.splitlines()
    assert first == "['lo']"
    assert [line.split(":")[0].strip() for line in dev[2:] if line.strip()] == ["lo"]


# --- file system --------------------------------------------------------------------------
def test_cannot_write_host_files(tmp_path):
    """Writes to the host's tmp dir or to /work land nowhere on the host."""
    marker = tmp_path / "marker"
    targets = [str(marker), "/work/main/pwned", "/tmp/pwned-by-sandbox"]
    code = (
        f"for path in {targets!r}:\n    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
        "    except OSError as e:\n        print('blocked', path, type(e).__name__)\n"
    )
    r = run_python(code)
    assert r.returncode == 0 and "blocked " + str(marker) in r.stdout and "blocked /work/main/pwned" in r.stdout
    assert not any(os.path.exists(t) for t in targets)


def test_cannot_read_host_files(tmp_path):
    """A secret file the test writes, /root and the project tree are invisible inside."""
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    code = (
        "import os\nfor p in [%r, '/root', '/work', '/home', '/etc/passwd']:\n    print(p, os.path.exists(p))\n"
        "print(open(%r).read())"
    ) % (str(secret), str(secret))
    r = run_python(code)
    assert r.returncode != 0 and "FileNotFoundError" in r.stderr and "TOP-SECRET" not in r.stdout
    assert all(line.endswith("False") for line in r.stdout.splitlines())


# --- processes, signals, environment ------------------------------------------------------
def test_killing_the_parent_is_harmless():
    """kill(getppid(), SIGKILL) and kill -9 -1 hit nothing outside; a result still comes back."""
    code = (  # A sibling first, so kill(-1) has something to hit (else it fails with ESRCH).
        "import os, signal, subprocess\nsubprocess.Popen(['sleep', '30'])\n"
        "os.kill(os.getppid(), signal.SIGKILL)\nos.kill(-1, signal.SIGKILL)\nprint('still here')"
    )
    r = run_python(code)
    assert r.stdout == "still here\n" and r.returncode == 0
    r = run_python(f"import os\nos.kill({os.getpid()}, 9)")  # The test's host PID: not visible inside.
    assert r.returncode != 0 and "ProcessLookupError" in r.stderr
    _host_is_fine()


def test_no_controlling_terminal():
    """A new session: there is no terminal to inject keystrokes into (TIOCSTI)."""
    r = run_python("import os\nprint(os.getsid(0) == os.getpid())\nopen('/dev/tty')")
    assert r.stdout == "True\n" and r.returncode != 0 and "OSError" in r.stderr


def test_program_has_no_privileges():
    """No capabilities, no nested namespaces, no access to the runner's memory or descriptors."""
    code = (
        "import ctypes, os\ncaps = [l.split()[1] for l in open('/proc/self/status')\n"
        "        if l[:6] in ('CapEff', 'CapPrm', 'CapAmb')]\n"
        "print(set(caps))\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print([libc.unshare(flag) for flag in (0x10000000, 0x40000000, 0x00020000)])\n"
        "for path in ['/proc/1/mem', '/proc/1/environ', '/proc/1/fd/0']:\n    try:\n        open(path, 'rb')\n"
        "        print('opened', path)\n    except OSError:\n        pass"
    )
    r = run_python(code)
    assert r.stdout.splitlines() == ["{'0000000000000000'}", "[-1, -1, -1]"], r


def test_sandbox_dies_with_its_caller():
    """If the calling process is SIGKILLed mid-run, the sandbox and its program die too."""
    before = _sandbox_like_pids()
    caller = subprocess.Popen(
        [sys.executable, "-c", f"from titanrl.envs import run_python\nrun_python({SLEEP_60!r}, timeout_s=60)"],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    deadline = time.monotonic() + 10
    while not any(_stat(str(p)) for p in _sandbox_like_pids() if p != caller.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # Let the program itself start inside.
    caller.kill()
    caller.wait()
    _assert_all_gone(before)


def test_environment_is_not_leaked(monkeypatch):
    """A secret in the caller's environment is absent inside; only a minimal env is set."""
    monkeypatch.setenv("TITANRL_TEST_SECRET", "hunter2")
    r = run_python("import os\nprint(sorted(os.environ))\nprint(os.environ)")
    assert "hunter2" not in r.stdout and r.stdout.splitlines()[0] == "['HOME', 'LANG', 'PATH', 'TMPDIR']"


# --- the pool -----------------------------------------------------------------------------
def test_pool_runs_concurrently_up_to_size():
    """Eight 1 s programs on four slots all succeed, and at their busiest exactly four ran at once
    (each program reports when it started and ended; the host's monotonic clock is shared)."""
    program = "import time\nstart = time.monotonic()\ntime.sleep(1.0)\nprint({i}, start, time.monotonic())"

    async def main() -> list:
        async with SandboxPool(size=4) as pool:
            return await asyncio.gather(*(pool.run(program.format(i=i)) for i in range(8)))

    results = asyncio.run(asyncio.wait_for(main(), 120))  # a hang guard only
    reports = [r.stdout.split() for r in results]
    assert [int(i) for i, _, _ in reports] == list(range(8))
    # Ends before starts at equal times: touching intervals did not overlap.
    events = sorted([(float(t0), 1) for _, t0, _ in reports] + [(float(t1), -1) for _, _, t1 in reports])
    running = [sum(change for _, change in events[: k + 1]) for k in range(len(events))]
    assert max(running) == 4


def test_pool_calls_start_from_a_clean_state():
    """Files, shared memory and background processes of one call are gone in the next."""
    dirty = (
        "import os, subprocess\nfor p in ['left', '/tmp/left', '/dev/shm/left']:\n    open(p, 'w').write('x')\n"
        "subprocess.Popen(['sleep', '60'], start_new_session=True)\nprint('ok')"
    )
    check = (
        "import os\nprint(os.listdir('.'), os.listdir('/tmp'), os.listdir('/dev/shm'))\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
    )

    async def main() -> list:
        async with SandboxPool(size=1) as pool:
            return [await pool.run(dirty), await pool.run(check)]

    first, second = asyncio.run(main())
    assert first.stdout == "ok\n"
    listing, pids = second.stdout.splitlines()
    assert listing == "['main.py'] [] []"
    assert len(eval(pids)) == 2  # The runner (PID 1) and the checking program itself.


def test_pool_survives_timeouts_crashes_and_kill_all():
    """A timeout, a segfault and kill -9 -1 in one call leave the slot working, with no restart."""

    async def main() -> tuple[list, int]:
        async with SandboxPool(size=1) as pool:
            results = [
                await pool.run("while True: pass", timeout_s=0.5),
                await pool.run("import ctypes\nctypes.string_at(0)"),
                await pool.run("import os, subprocess\nsubprocess.Popen(['sleep', '9'])\n"
                               "os.kill(-1, 9)\nos.kill(1, 9)\nprint('alive')"),
                await pool.run("print('fine')"),
            ]
            return results, pool.restarts

    results, restarts = asyncio.run(main())
    assert results[0].timed_out and results[1].returncode == -11 and results[2].stdout == "alive\n"
    assert results[3].stdout == "fine\n" and restarts == 0


def test_pool_replaces_a_dead_sandbox():
    """If a whole sandbox dies, that call gets a sandbox_error result and the slot is restarted."""

    async def main() -> tuple[list, int]:
        async with SandboxPool(size=1) as pool:
            (sandbox,) = pool._all
            os.killpg(sandbox.pid, 9)
            return [await pool.run("print(1)"), await pool.run("print(2)")], pool.restarts

    (broken, fine), restarts = asyncio.run(main())
    assert broken.killed_reason == "sandbox_error" and broken.returncode == -1
    assert fine.stdout == "2\n" and restarts == 1


# --- the host never waits for good --------------------------------------------------------
def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _our_bwraps() -> set[int]:
    """bwrap processes (or setpriv about to exec one) started by this test process."""
    found = set()
    for pid in _children(os.getpid()):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() in ("bwrap", "setpriv"):
                    found.add(pid)
        except OSError:
            pass
    return found


def test_cancelled_start_ends_at_once_and_leaves_nothing():
    """Cancelling a start while bwrap is still setting the sandbox up finishes within 3 s, and
    (through `no_leftovers`) leaves no process behind.

    Regression: asyncio's own clean-up of a cancelled create_subprocess_exec SIGKILLed bwrap
    alone; bwrap's child, not yet bound by --die-with-parent, lived on holding the pipes, and the
    cancelled start waited for them forever (a pool.run cancelled by a tool timeout hung its whole
    episode batch). The loop is blocked while bwrap clones, so the cancel lands in that window
    every time: without the fix all three starts hang.
    """

    async def main() -> list[bool]:
        finished = []
        for _ in range(3):
            old = _our_bwraps()
            task = asyncio.create_task(Sandbox().start())
            for _ in range(20):  # Let it fork bwrap, but no further than that.
                await asyncio.sleep(0)
                if new := _our_bwraps() - old:
                    break
            deadline = time.monotonic() + 5
            while not any(_children(p) for p in new) and time.monotonic() < deadline:
                time.sleep(0.0005)  # Blocking on purpose: asyncio must not finish wiring the pipes.
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=3)
            finished.append(task in done)
            if task not in done:  # Unstick it, so the failure is reported rather than hung.
                task.cancel()
                await asyncio.wait({task}, timeout=3)
        return finished

    assert asyncio.run(main()) == [True, True, True]


def test_a_runner_that_never_answers_fails_the_call_in_time():
    """A runner that stops answering (SIGSTOPped) costs the call about timeout_s + kill_grace_s,
    then a sandbox_error result; the pool replaces the slot and the next call works."""
    config = SandboxConfig(kill_grace_s=0.5)

    async def main() -> tuple:
        async with SandboxPool(size=1, config=config) as pool:
            (sandbox,) = pool._all
            (runner,) = _children(sandbox.pid)  # bwrap's child: the sandbox's PID 1, our runner.
            os.kill(runner, signal.SIGSTOP)
            start = time.monotonic()
            stuck = await pool.run("print(1)", timeout_s=0.5)
            elapsed = time.monotonic() - start
            return stuck, elapsed, await pool.run("print(2)"), pool.restarts

    # The overall guard turns a hang into a failure; the call itself waits out timeout_s + kill_grace_s.
    stuck, elapsed, after, restarts = asyncio.run(asyncio.wait_for(main(), 30.0))
    assert stuck.killed_reason == "sandbox_error" and stuck.returncode == -1 and "TimeoutError" in stuck.stderr
    assert elapsed >= 0.5 + config.kill_grace_s, elapsed  # not given up before the runner's time was up
    assert after.stdout == "2\n" and restarts == 1


# --- availability and the weaker mode -----------------------------------------------------
def test_missing_bwrap_is_a_clear_error_not_a_fallback():
    """Without bubblewrap, run_python raises with the install line instead of running unsandboxed."""
    with pytest.raises(SandboxUnavailableError, match="apt-get install -y bubblewrap"):
        run_python("print(1)", config=SandboxConfig(bwrap="/nonexistent/bwrap"))


def test_rlimits_mode_applies_limits_and_clears_env(monkeypatch):
    """The explicit rlimit-only mode: cleared env, temp cwd removed after, timeouts and NPROC."""
    monkeypatch.setenv("TITANRL_TEST_SECRET", "hunter2")
    cfg = SandboxConfig(isolation="rlimits")
    r = run_python("import os\nprint(os.getcwd())\nprint(sorted(os.environ))", config=cfg)
    cwd, env = r.stdout.splitlines()
    assert env == "['HOME', 'LANG', 'PATH', 'TMPDIR']" and not os.path.exists(cwd)
    assert run_python("while True: pass", config=cfg, timeout_s=0.5).timed_out
    r = run_python("x = bytearray(4 << 30)", config=cfg)
    assert "MemoryError" in r.stderr


def test_rlimits_mode_kills_background_processes():
    """In rlimit-only mode a daemonized grandchild is still found (subreaper) and killed."""
    code = "import subprocess\nsubprocess.Popen(['sleep', '60'], start_new_session=True)\nprint('spawned')"
    r = run_python(code, config=SandboxConfig(isolation="rlimits"))
    assert r.stdout == "spawned\n"  # `no_leftovers` proves the sleep is gone.


def test_config_validation():
    """Nonsense limits are rejected when the config is built, naming the field."""
    with pytest.raises(ValueError, match="memory_bytes"):
        SandboxConfig(memory_bytes=0)
    with pytest.raises(ValueError, match="/var/tmp"):
        SandboxConfig(python_path=("/tmp/site-packages",))
    with pytest.raises(ValueError, match="isolation"):
        SandboxConfig(isolation="none")  # type: ignore[arg-type]
