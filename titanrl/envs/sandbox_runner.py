"""The trusted program that runs *inside* a sandbox and executes untrusted code, one job at a time.

The host starts it as `python3 -I -c <this file's source> <settings JSON>` (inside bubblewrap, or
as a plain subprocess in the weaker rlimit-only mode), so it must use the standard library only
and must not import titanrl. Protocol on stdin/stdout, every frame a 4-byte big-endian length
followed by that many bytes:

  host -> runner: JSON job {"code", "stdin", "timeout_s"}
  runner -> host: JSON header {"returncode", "timed_out", "killed_reason", "wall_s",
                  "stdout_truncated", "stderr_truncated", "stdout_len", "stderr_len"},
                  then the raw stdout bytes and the raw stderr bytes.

The runner writes one `{"ready": true}` header first, so the host knows start-up succeeded.

Why a long-lived runner: bubblewrap start-up (namespaces, mounts) and one Python start are paid
once per sandbox, not per execution; each job is a fresh fork with its own limits. In bubblewrap
mode the runner is PID 1 of the sandbox's PID namespace (`--as-pid-1`), which makes it immune to
SIGKILL from the untrusted code, lets `kill(-1)` clean up every process the job left behind, and
makes every orphan its child to reap. Each job also gets its own mount and IPC namespaces with
fresh tmpfs mounts, so no file, shared-memory segment or message queue survives into the next job.
"""

import ctypes
import json
import os
import resource
import selectors
import shutil
import signal
import struct
import sys
import tempfile
import time

# Linux constants (not all exposed by the `os` module of Python 3.11).
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 1 << 14, 1 << 18
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 4, 38, 47, 4
PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG = 36, 1
CAP_VERSION_3 = 0x20080522
READ_CHUNK = 65536
# After the main process exits, background processes still holding stdout get this long.
EXIT_GRACE_S = 0.05

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _read_exact(fd: int, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _write_frame(fd: int, *parts: bytes) -> None:
    data = b"".join(parts)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _header(obj: dict) -> bytes:
    raw = json.dumps(obj).encode()
    return struct.pack(">I", len(raw)) + raw


def _drop_capabilities() -> None:
    """Clear the capabilities bubblewrap left us (`--cap-add CAP_SYS_ADMIN`) before exec.

    Ambient capabilities would survive execve, so they go first; then the permitted/effective/
    inheritable sets become empty, and execve of a non-root uid cannot regain anything.
    """
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient caps")
    header = (ctypes.c_uint32 * 2)(CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(_libc.capset(header, data), "capset")


def _fresh_mounts(settings: dict) -> None:
    """New mount + IPC namespace with empty size-capped tmpfs on every writable path."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWIPC), "unshare")
    # Private, so nothing we mount propagates back into the runner's namespace.
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    for path, mode in ((settings["workdir"], "0700"), ("/tmp", "1777"), ("/dev/shm", "1777")):
        opts = f"size={settings['tmpfs_bytes']},mode={mode}".encode()
        _check(_libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts), f"mount {path}")


def _set_limits(settings: dict, timeout_s: float) -> None:
    cpu_s = settings["cpu_s"] or int(timeout_s) + 1
    limits = {
        resource.RLIMIT_CPU: cpu_s,
        resource.RLIMIT_AS: settings["memory_bytes"],
        resource.RLIMIT_NPROC: settings["max_processes"],
        resource.RLIMIT_FSIZE: settings["max_file_bytes"],
        resource.RLIMIT_NOFILE: settings["max_open_files"],
        resource.RLIMIT_CORE: 0,
    }
    for which, value in limits.items():
        resource.setrlimit(which, (value, value))


def _exec_child(settings: dict, job: dict, workdir: str, fds: tuple[int, int, int]) -> None:
    """Runs in the forked child: isolate, limit, exec. Never returns."""
    try:
        os.setsid()  # Own process group: the runner can kill the job's group in rlimit-only mode.
        if settings["namespaces"]:
            _fresh_mounts(settings)
        path = os.path.join(workdir, "main.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(job["code"])
        os.chdir(workdir)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 1 << 16)
        if settings["namespaces"]:
            _drop_capabilities()
        _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # Runner gone -> job gone.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        _set_limits(settings, job["timeout_s"])
        tmpdir = "/tmp" if settings["namespaces"] else workdir
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": tmpdir, "LANG": "C.UTF-8"}
        if settings["python_path"]:
            env["PYTHONPATH"] = os.pathsep.join(settings["python_path"])
        # -s: no user site-packages. The environment above is the whole environment.
        os.execve(settings["python"], [settings["python"], "-s", "main.py"], env)
    except BaseException as exc:  # noqa: BLE001 - any failure must end the child, not return
        os.write(2, f"sandbox: could not start the program: {exc!r}\n".encode())
    finally:
        os._exit(126)


def _my_children() -> list[int]:
    """PIDs whose parent is this runner (orphans land here: PID 1 or child subreaper)."""
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(b")", 1)[1].split()[1]) == me:
                found.append(int(name))
    return found


def _kill_everything(settings: dict, job_pgid: int) -> None:
    """SIGKILL every process the job created and reap them, repeating until none is left."""
    while True:
        if settings["namespaces"]:
            try:  # PID 1 of its own namespace: everything but us, including daemonized grandchildren.
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        else:
            for pid in [-job_pgid, *_my_children()]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _spawn(settings: dict, job: dict, workdir: str) -> tuple[int, int, int, int]:
    """Fork the job's process; returns (pid, stdin writer, stdout reader, stderr reader)."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _exec_child(settings, job, workdir, (in_r, out_w, err_w))
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    return pid, in_w, out_r, err_r


def _drain(fd: int, buf: bytearray, cap: int) -> bool:
    """Read what is left once every writer is dead; True if more than `cap` bytes were there."""
    while True:
        chunk = os.read(fd, READ_CHUNK)
        if not chunk:
            return False
        room = cap - len(buf)
        buf += chunk[:room]
        if len(chunk) > room:
            return True


def _run_job(settings: dict, job: dict) -> tuple[dict, bytes, bytes]:
    start = time.monotonic()
    workdir = settings["workdir"] if settings["namespaces"] else tempfile.mkdtemp(prefix="sandbox-")
    pid, in_w, out_r, err_r = _spawn(settings, job, workdir)
    pidfd = os.pidfd_open(pid)
    cap = settings["max_output_bytes"]
    out = {out_r: bytearray(), err_r: bytearray()}
    truncated = {out_r: False, err_r: False}
    open_outputs = {out_r, err_r}
    stdin = memoryview(job["stdin"].encode())
    sel = selectors.DefaultSelector()
    for fd in (out_r, err_r, pidfd):
        sel.register(fd, selectors.EVENT_READ)
    os.set_blocking(in_w, False)
    if stdin:
        sel.register(in_w, selectors.EVENT_WRITE)
    else:
        os.close(in_w)
        in_w = -1
    deadline = start + job["timeout_s"]
    status: int | None = None
    killed_reason: str | None = None
    until = deadline
    while killed_reason is None:
        now = time.monotonic()
        if now >= until:
            killed_reason = "timeout" if status is None else None
            break
        if status is not None and not open_outputs:
            break
        for key, _ in sel.select(until - now):
            fd = key.fd
            if fd == pidfd:
                status = os.waitpid(pid, 0)[1]
                sel.unregister(pidfd)
                until = min(deadline, time.monotonic() + EXIT_GRACE_S)
            elif fd == in_w:
                try:
                    stdin = stdin[os.write(in_w, stdin[:READ_CHUNK]) :]
                except BrokenPipeError:
                    stdin = stdin[:0]
                if not stdin:
                    sel.unregister(in_w)
                    os.close(in_w)
                    in_w = -1
            else:
                chunk = os.read(fd, READ_CHUNK)
                if not chunk:
                    sel.unregister(fd)
                    open_outputs.discard(fd)
                    continue
                room = cap - len(out[fd])
                out[fd] += chunk[:room]
                if len(chunk) > room:
                    truncated[fd] = True
                    killed_reason = "output_limit"
    sel.close()
    if status is None:
        os.kill(pid, signal.SIGKILL)
        status = os.waitpid(pid, 0)[1]
    _kill_everything(settings, pid)
    for fd in open_outputs:
        truncated[fd] |= _drain(fd, out[fd], cap)
    for fd in (out_r, err_r, pidfd, in_w):
        if fd >= 0:
            os.close(fd)
    if not settings["namespaces"]:
        shutil.rmtree(workdir, ignore_errors=True)
    header = {
        "returncode": os.waitstatus_to_exitcode(status),
        "timed_out": killed_reason == "timeout",
        "killed_reason": killed_reason,
        "wall_s": time.monotonic() - start,
        "stdout_truncated": truncated[out_r],
        "stderr_truncated": truncated[err_r],
        "stdout_len": len(out[out_r]),
        "stderr_len": len(out[err_r]),
    }
    return header, bytes(out[out_r]), bytes(out[err_r])


def main() -> None:
    settings = json.loads(sys.argv[1])
    # Untrusted jobs run as our uid; not dumpable means they cannot ptrace us or open /proc/1/mem.
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not settings["namespaces"]:
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # Orphans come to us, so we can kill them.
    rfd, wfd = sys.stdin.fileno(), sys.stdout.fileno()
    _write_frame(wfd, _header({"ready": True}))
    while True:
        try:
            (length,) = struct.unpack(">I", _read_exact(rfd, 4))
            job = json.loads(_read_exact(rfd, length))
        except EOFError:
            return
        header, out, err = _run_job(settings, job)
        _write_frame(wfd, _header(header), out, err)


if __name__ == "__main__":
    main()
