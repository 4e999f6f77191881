"""Run untrusted, model-written Python in a bubblewrap sandbox.

`run_python(code)` starts a sandbox, runs one program, and tears it down. `SandboxPool` (in
sandbox_pool.py) keeps sandboxes warm for rollouts. Both drive the same `Sandbox`: one bubblewrap
process whose PID 1 is the trusted runner in sandbox_runner.py, which forks one child per
program with fresh tmpfs mounts and rlimits (see that file for why).

Isolation in the default `isolation="bwrap"` mode:
- namespaces: user, PID, network (only its own loopback), IPC, UTS, cgroup, mount; a new session
  (no TIOCSTI into the caller's terminal); dies with the caller (`--die-with-parent`).
- files: read-only /usr (and the /bin, /lib, /lib64, /sbin links to it), /etc/ld.so.cache, a
  fresh /proc and minimal /dev; empty size-capped tmpfs /tmp, /dev/shm and the work dir per
  program. No /work, /root, /home, or anything else of the host's.
- identity: started by root, the sandbox runs as the unprivileged host uid `run_as_uid`
  (nobody). That is what makes RLIMIT_NPROC bite: the kernel never enforces it for host uid 0,
  even inside a user namespace (measured: a root-mapped sandbox forked past the limit).
- interpreter: the system's /usr/bin/python3 (not the caller's sys.executable, whose venv and
  pyenv prefix live outside /usr), with no user site-packages (-s) and an environment of only
  PATH, HOME, TMPDIR, LANG; it sees the standard library and Debian's dist-packages, never the
  caller's virtualenv unless `python_path` names its site-packages.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import struct
import threading
from collections.abc import Coroutine
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

INSTALL_HINT = "apt-get install -y bubblewrap"
_RUNNER_SOURCE = (Path(__file__).with_name("sandbox_runner.py")).read_text()
# Frames from the runner are untrusted-adjacent: cap what we are willing to read.
_MAX_HEADER_BYTES = 1 << 16
_T = TypeVar("_T")


class SandboxUnavailableError(RuntimeError):
    """The sandbox cannot be started here (bubblewrap missing, namespaces refused, ...)."""


@dataclass(frozen=True)
class SandboxConfig:
    """How untrusted code is isolated and limited. Defaults suit short code-RL episodes."""

    isolation: Literal["bwrap", "rlimits"] = "bwrap"
    """'bwrap' (namespaces + rlimits) is the real sandbox. 'rlimits' is a weaker explicit opt-in
    for machines without bubblewrap: a plain subprocess with rlimits, cleared env and a temp
    cwd, which can still read host files and use the network. Never chosen automatically."""
    python: str = "/usr/bin/python3"
    """Interpreter for the untrusted code; must live under a mounted path (/usr by default)."""
    timeout_s: float = 5.0
    """Default wall-clock limit per program; the whole process tree is killed when it passes."""
    cpu_s: int | None = None
    """RLIMIT_CPU per process in seconds; None means the wall timeout rounded up, plus one."""
    memory_bytes: int = 1 << 30
    """RLIMIT_AS per process: address space, so allocations beyond it fail with MemoryError."""
    max_processes: int = 64
    """RLIMIT_NPROC: processes of the sandbox's uid inside its user namespace (stops fork bombs)."""
    max_file_bytes: int = 16 << 20
    """RLIMIT_FSIZE: largest file the program may write."""
    max_open_files: int = 256
    """RLIMIT_NOFILE: open file descriptors per process."""
    max_output_bytes: int = 1 << 20
    """Bytes kept of stdout and of stderr each; past this the program is killed and marked truncated."""
    tmpfs_bytes: int = 64 << 20
    """Size of each writable tmpfs (work dir, /tmp, /dev/shm), so disk writes cannot eat host RAM."""
    run_as_uid: int = 65534
    """Host uid (and gid) the sandbox runs as when the caller is root; ignored otherwise."""
    python_path: tuple[str, ...] = ()
    """Host directories mounted read-only and put on the program's sys.path (PYTHONPATH), e.g. a
    venv's site-packages to allow; by default the program sees only the system's packages."""
    extra_ro_binds: tuple[str, ...] = ()
    """Extra host paths mounted read-only at the same place (data files, tools)."""
    bwrap: str = "bwrap"
    """bubblewrap executable (name on PATH or absolute path)."""
    startup_timeout_s: float = 10.0
    """How long a sandbox may take to start before it is treated as broken."""
    kill_grace_s: float = 2.0
    """Host-side slack past `timeout_s` before the whole sandbox is killed from outside."""
    workdir: str = "/sandbox"
    """Writable, initially empty working directory inside the sandbox (holds main.py)."""

    def __post_init__(self) -> None:
        if self.isolation not in ("bwrap", "rlimits"):
            raise ValueError(f"SandboxConfig.isolation must be 'bwrap' or 'rlimits', got {self.isolation!r}")
        for name in ("timeout_s", "memory_bytes", "max_processes", "max_file_bytes", "max_open_files",
                     "max_output_bytes", "tmpfs_bytes", "startup_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be positive, got {getattr(self, name)!r}")
        if not os.path.isabs(self.python) or not os.path.isabs(self.workdir):
            raise ValueError("SandboxConfig.python and .workdir must be absolute paths")
        if self.workdir in ("/", "/tmp", "/usr", "/proc", "/dev"):
            raise ValueError(f"SandboxConfig.workdir must be a path of its own, got {self.workdir!r}")
        for path in (*self.python_path, *self.extra_ro_binds):
            # These are replaced by fresh tmpfs/proc/dev mounts inside, which would hide the bind.
            if any(path == top or path.startswith(top + "/") for top in ("/tmp", "/dev", "/proc", self.workdir)):
                raise ValueError(f"SandboxConfig: {path!r} is under a path the sandbox mounts afresh "
                                 "(/tmp, /dev, /proc, workdir); move it elsewhere (e.g. /var/tmp)")


@dataclass
class SandboxResult:
    """What one program did. Errors of the program are data here, never exceptions."""

    stdout: str
    """Standard output (UTF-8, undecodable bytes replaced), at most `max_output_bytes`."""
    stderr: str
    """Standard error, same rules; a traceback lands here."""
    returncode: int
    """Exit status; negative for a signal (-9 when killed), -1 when the sandbox itself failed."""
    timed_out: bool
    """True when the wall-clock limit killed the program."""
    wall_s: float = 0.0
    """Seconds from fork to the end of clean-up, as measured inside the sandbox."""
    killed_reason: str | None = None
    """'timeout', 'output_limit', 'sandbox_error' (runner crashed or hung), or None."""
    stdout_truncated: bool = False
    """stdout exceeded `max_output_bytes` and was cut."""
    stderr_truncated: bool = False
    """stderr exceeded `max_output_bytes` and was cut."""

    @property
    def ok(self) -> bool:
        """Exited with status 0 and was not killed."""
        return self.returncode == 0 and self.killed_reason is None


def _sandbox_error(message: str) -> SandboxResult:
    return SandboxResult("", f"sandbox error: {message}", -1, False, killed_reason="sandbox_error")


def _bwrap_argv(config: SandboxConfig, bwrap: str) -> list[str]:
    argv = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
            # No nested user namespaces: they would hand the program a full capability set there.
            "--disable-userns",
            # The runner is PID 1: SIGKILL-proof from inside, reaper of every orphan.
            "--as-pid-1",
            # Only the runner keeps this (to mount fresh tmpfs per program); it drops it before exec.
            "--cap-add", "CAP_SYS_ADMIN",
            "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
            "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
        if os.path.islink(top):  # merged-/usr systems: recreate the link, do not bind.
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    if os.path.exists("/etc/ld.so.cache"):
        argv += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for path in (*config.python_path, *config.extra_ro_binds):
        argv += ["--ro-bind", path, path]
    small = str(1 << 20)  # Mount points only; each program gets its own tmpfs on top.
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--size", small, "--tmpfs", "/tmp", "--size", small, "--tmpfs", "/dev/shm",
             "--size", small, "--tmpfs", config.workdir, "--chdir", config.workdir,
             "--remount-ro", "/dev", "--remount-ro", "/"]
    return argv


def _runner_settings(config: SandboxConfig) -> str:
    keys = ("python", "cpu_s", "memory_bytes", "max_processes", "max_file_bytes", "max_open_files",
            "max_output_bytes", "tmpfs_bytes", "workdir", "python_path")
    settings = {k: v for k, v in asdict(config).items() if k in keys}
    settings["namespaces"] = config.isolation == "bwrap"
    return json.dumps(settings)


def sandbox_argv(config: SandboxConfig) -> list[str]:
    """The full command line of one sandbox; raises SandboxUnavailableError when it cannot run."""
    runner = [config.python, "-I", "-c", _RUNNER_SOURCE, _runner_settings(config)]
    if not os.access(config.python, os.X_OK):
        raise SandboxUnavailableError(f"sandbox interpreter {config.python!r} is not executable; "
                                      "set SandboxConfig.python to a Python 3 under /usr")
    if config.isolation == "rlimits":
        return runner
    bwrap = shutil.which(config.bwrap)
    if bwrap is None:
        raise SandboxUnavailableError(
            f"bubblewrap ({config.bwrap!r}) is not installed; install it with `{INSTALL_HINT}` "
            "(Debian/Ubuntu), or opt in to the weaker SandboxConfig(isolation='rlimits')")
    return _bwrap_argv(config, bwrap) + runner


class Sandbox:
    """One live sandbox running the trusted runner; programs run in it one at a time.

    A program that crashes, times out or floods output leaves the sandbox usable; only a hung or
    dead runner marks it `broken`, and then every later `run` returns a sandbox_error result.
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self.argv = sandbox_argv(self.config)  # Fails fast, before any process starts.
        self.broken = False
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        """Host PID of the sandbox's outermost process (bwrap, or the runner in rlimits mode)."""
        return self._proc.pid if self._proc else None

    async def start(self) -> None:
        """Start the sandbox and wait for the runner's ready frame."""
        argv = self.argv
        if os.geteuid() == 0:
            # Drop root with util-linux's setpriv rather than create_subprocess_exec(user=...):
            # uvloop (Ray actors' event loop) rejects the user/group keyword arguments.
            setpriv = shutil.which("setpriv")
            if setpriv is None:
                raise SandboxUnavailableError("setpriv (util-linux) is needed to drop root for the sandbox")
            uid = self.config.run_as_uid
            argv = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv]
        self._proc = await self._spawn(argv)
        try:
            ready = await asyncio.wait_for(self._read_header(), self.config.startup_timeout_s)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            await self.close()
            detail = await self._stderr_tail()
            raise SandboxUnavailableError(f"sandbox failed to start ({exc!r}): {detail or 'no output'}; "
                                          f"command: {self.argv[:3]} ...") from None
        except asyncio.CancelledError:
            # Nobody will close a sandbox whose start was cancelled: kill it now, not at exit.
            await self._kill_and_reap()
            raise
        if ready != {"ready": True}:
            await self.close()
            raise SandboxUnavailableError(f"sandbox runner sent an unexpected greeting: {ready!r}")

    async def _spawn(self, argv: list[str]) -> asyncio.subprocess.Process:
        """create_subprocess_exec that a cancellation cannot interrupt half-way.

        asyncio's own clean-up of a cancelled create_subprocess_exec SIGKILLs bwrap alone, then
        waits until all three pipes close (Python 3.11). bwrap arms --die-with-parent in its child
        only just before exec'ing the runner, so a child caught in set-up outlives bwrap (seen:
        blocked for good on bwrap's eventfd, or an orphaned idle runner), holds the pipes open,
        and that wait, with the caller's cancellation, never ends: the hang of two processes whose
        tool calls timed out. Instead the spawn always finishes (milliseconds) and _kill then
        takes the whole tree down.
        """
        spawn = asyncio.ensure_future(asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={}, cwd="/", start_new_session=True))
        try:
            return await asyncio.shield(spawn)
        except asyncio.CancelledError as cancel:
            while not spawn.done():  # Not returning before it is done, or the loop could end first.
                try:
                    await asyncio.wait({spawn})
                except asyncio.CancelledError:
                    pass
            if not spawn.cancelled() and spawn.exception() is None:
                self._proc = spawn.result()
                await self._kill_and_reap()
            raise cancel

    async def _read_header(self) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdout is not None
        (length,) = struct.unpack(">I", await self._proc.stdout.readexactly(4))
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"runner header of {length} bytes")
        return json.loads(await self._proc.stdout.readexactly(length))

    async def _exchange(self, job: dict[str, Any]) -> SandboxResult:
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        raw = json.dumps(job).encode()
        self._proc.stdin.write(struct.pack(">I", len(raw)) + raw)
        await self._proc.stdin.drain()
        head = await self._read_header()
        cap = self.config.max_output_bytes
        if not (0 <= head["stdout_len"] <= cap and 0 <= head["stderr_len"] <= cap):
            raise ValueError(f"runner reported impossible output sizes: {head!r}")
        out = await self._proc.stdout.readexactly(head["stdout_len"])
        err = await self._proc.stdout.readexactly(head["stderr_len"])
        return SandboxResult(
            stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
            returncode=int(head["returncode"]), timed_out=bool(head["timed_out"]),
            wall_s=float(head["wall_s"]), killed_reason=head["killed_reason"],
            stdout_truncated=bool(head["stdout_truncated"]), stderr_truncated=bool(head["stderr_truncated"]))

    async def run(self, code: str, *, stdin: str = "", timeout_s: float | None = None) -> SandboxResult:
        """Run `code` as a fresh `python3 -I main.py` in this sandbox and return what happened."""
        if self._proc is None:
            await self.start()
        if self.broken:
            return _sandbox_error("this sandbox is broken; start a new one")
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
        job = {"code": code, "stdin": stdin, "timeout_s": timeout}
        async with self._lock:  # One program at a time: the runner's protocol is strictly sequential.
            try:
                return await asyncio.wait_for(self._exchange(job), timeout + self.config.kill_grace_s)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError, KeyError) as exc:
                # The runner hung, died or lied: nothing it says can be trusted any more.
                self.broken = True
                await self.close()
                return _sandbox_error(f"runner failed: {exc!r}; runner stderr: {await self._stderr_tail()!r}")
            except asyncio.CancelledError:
                # A reply is still pending, so the protocol is out of step: kill it now.
                await self._kill_and_reap()
                raise

    async def _stderr_tail(self) -> str:
        """What the runner or bwrap said on stderr (only read once the process is gone)."""
        if self._proc is None or self._proc.stderr is None or self._proc.returncode is None:
            return ""
        try:  # Bounded: EOF needs every writer gone, and a diagnostic must never hang the caller.
            return (await asyncio.wait_for(self._proc.stderr.read(4096), 0.5)).decode(errors="replace").strip()
        except asyncio.TimeoutError:
            return ""

    def _kill(self) -> None:
        """SIGKILL bwrap and its child, the sandbox's PID 1 (the kernel then kills the namespace).

        The child is killed by name, not left to --die-with-parent: bwrap arms that only right
        before exec'ing the runner, so killing bwrap during start-up would leave it running.
        """
        proc = self._proc
        if proc is not None and proc.stdin is not None:
            proc.stdin.close()  # Else the transport's __del__ closes it, maybe after the loop is gone.
        if proc is None or proc.returncode is not None:
            return
        try:
            # Stopped first: a pending signal makes clone() fail, so no child appears after the listing.
            os.kill(proc.pid, signal.SIGSTOP)
        except ProcessLookupError:
            return
        try:
            for child in _child_pids(proc.pid):
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def _kill_and_reap(self) -> None:
        """For cancelled calls: _kill, then wait (bounded) until asyncio has seen the exit, so no
        transport is left for the garbage collector to close after the loop is gone."""
        self.broken = True
        self._kill()
        if self._proc is not None:
            try:
                await asyncio.wait_for(self._proc.wait(), self.config.kill_grace_s)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass  # The caller is re-raising its own cancellation anyway.

    async def close(self) -> None:
        """Kill the sandbox (the PID namespace takes every process in it along) and reap it."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        self.broken = True
        if proc.stdin is not None:
            proc.stdin.close()
        try:  # The runner exits on EOF; give it a moment before forcing.
            await asyncio.wait_for(proc.wait(), 0.5)
        except asyncio.TimeoutError:
            self._kill()
            try:  # Bounded: Process.wait() also waits for the pipes to close (Python 3.11).
                await asyncio.wait_for(proc.wait(), self.config.kill_grace_s)
            except asyncio.TimeoutError:
                pass

    async def __aenter__(self) -> Sandbox:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (bwrap is single-threaded, so its main task has them all)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:  # Kernel without CONFIG_PROC_CHILDREN (or pid gone): scan every process's parent.
        found = []
        for name in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[1]) == pid:
                        found.append(int(name))
            except (OSError, IndexError, ValueError):
                continue
        return found


def _run_blocking(coro: Coroutine[Any, Any, _T]) -> _T:
    """asyncio.run, also from code that already runs inside an event loop (uses a thread then)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="titanrl-sandbox")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


async def run_python_async(code: str, *, stdin: str = "", timeout_s: float | None = None,
                           config: SandboxConfig | None = None) -> SandboxResult:
    """One program in a one-off sandbox, without blocking the event loop."""
    async with Sandbox(config) as sandbox:
        return await sandbox.run(code, stdin=stdin, timeout_s=timeout_s)


def run_python(code: str, *, stdin: str = "", timeout_s: float | None = None,
               config: SandboxConfig | None = None) -> SandboxResult:
    """Run untrusted `code` once in a fresh sandbox; errors of the code come back in the result.

    Raises only SandboxUnavailableError (the sandbox cannot start here) or ValueError (bad args).
    `timeout_s` defaults to `config.timeout_s` (5 s).
    """
    return _run_blocking(run_python_async(code, stdin=stdin, timeout_s=timeout_s, config=config))
