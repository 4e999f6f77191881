"""Reward for code: the fraction of hidden unit tests a candidate program passes in the sandbox.

One sandbox program (the trusted `HARNESS` below) gets the candidate code, the tests and a
random nonce on stdin, so none of them is in a file the candidate could read. It

1. compiles the candidate without running it (syntax errors end here),
2. forks a child that only executes the candidate (module-level crash, `exit`, a hang: stop here),
3. forks one fresh child per test: execute the candidate, then the test statement.

Each child has stdin/stdout/stderr on /dev/null, its own process group and a wall-clock
limit, and reports "ok" or the exception through a private pipe. Only the harness parent, which
never executes candidate code, writes to stdout: one line `<nonce> <json>` per step, as soon as
it is known. So junk output, fake result lines, `os._exit(0)`, crashes and infinite loops in
one test cannot turn into passes, and a later failure cannot erase earlier results. Tests run
independently: one test's side effects never reach another.

Not defended: a candidate that deliberately introspects its own process (walks frames or
memory, writes to the report pipe) or returns objects whose `__eq__` is always true. Those are
reward hacks to watch for with capable models; they need code that targets this harness.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

HARNESS = r'''
import json, os, select, signal, sys, time
_write, _exit, _devnull = os.write, os._exit, os.devnull


def child(r, w, code, test):
    try:
        os.close(r)
        os.setpgid(0, 0)
        null = os.open(_devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        ns = {"__name__": "__solution__", "__builtins__": __builtins__}  # not __main__: skip demo blocks
        try:
            exec(compile(code, "<solution>", "exec"), ns)
            if test is not None:
                exec(compile(test, "<test>", "exec"), ns)
            msg = "ok"
        except BaseException as e:  # SystemExit too: exiting is not passing
            try:
                msg = "fail " + type(e).__name__ + ": " + str(e)[:300]
            except BaseException:
                msg = "fail exception"
        _write(w, msg.encode("utf-8", "replace")[:1000])
    finally:
        _exit(0)


def run(code, test, timeout_s):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        child(r, w, code, test)
    os.close(w)
    deadline = time.monotonic() + timeout_s
    data, eof, status = b"", False, None
    while status is None and time.monotonic() < deadline:
        if eof:
            time.sleep(0.005)
        elif select.select([r], [], [], min(0.05, max(0.0, deadline - time.monotonic())))[0]:
            chunk = os.read(r, 4096)
            data, eof = data + chunk, not chunk
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
    if status is not None and not eof:  # exited: collect what is already in the pipe
        os.set_blocking(r, False)
        try:
            while len(data) < 4096:
                chunk = os.read(r, 4096)
                if not chunk:
                    break
                data += chunk
        except BlockingIOError:
            pass
    for kill in (os.killpg, os.kill):  # the child's grandchildren share its process group
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if status is None:
        os.waitpid(pid, 0)
    os.close(r)
    text = data.decode("utf-8", "replace")
    if text == "ok":
        return {"ok": True, "error": None, "timed_out": False}
    if status is None:
        return {"ok": False, "error": "timed out after %g s" % timeout_s, "timed_out": True}
    if text.startswith("fail "):
        return {"ok": False, "error": text[5:], "timed_out": False}
    return {"ok": False, "error": "exited without a result (status %d)" % os.waitstatus_to_exitcode(status),
            "timed_out": False}


def main():
    job = json.loads(sys.stdin.read())
    nonce = job["nonce"]

    def emit(obj):
        _write(1, (nonce + " " + json.dumps(obj) + "\n").encode())

    try:
        compile(job["code"], "<solution>", "exec")
    except BaseException as e:
        emit({"step": "compile", "ok": False, "error": "%s: %s" % (type(e).__name__, e)})
        return
    emit({"step": "compile", "ok": True})
    load = run(job["code"], None, job["timeout_s"])
    emit({"step": "load", **load})
    if not load["ok"]:
        return
    for i, test in enumerate(job["tests"]):
        emit({"step": "test", "i": i, **run(job["code"], test, job["timeout_s"])})


main()
'''


def harness_timeout_s(n_tests: int, timeout_s: float) -> float:
    """Whole-program limit: every step may use its own limit, plus slack for forks."""
    return timeout_s * (n_tests + 1) + 2.0


async def fraction_of_tests_passed(pool: Any, code: str, tests: list[str],
                                   timeout_s: float = 2.0) -> tuple[float, dict[str, Any]]:
    """(passed / len(tests), details) for `code` against assert-statement `tests`.

    `pool` is a started SandboxPool; `timeout_s` is the limit per test (and for loading the
    code). Never raises for anything the code does. `details` has `passed`, `total`,
    `results` (per test: ok, error, timed_out), `error` (None, "syntax_error", "load_error",
    "timeout", "sandbox_error", "no_tests"), `message` and `sandbox_s` (host wall seconds).
    """
    details: dict[str, Any] = {"passed": 0, "total": len(tests), "results": [], "error": None,
                               "message": "", "sandbox_s": 0.0}
    if not tests:
        details.update(error="no_tests", message="no tests given")
        return 0.0, details
    nonce = secrets.token_hex(16)
    job = json.dumps({"nonce": nonce, "code": code, "tests": list(tests), "timeout_s": timeout_s})
    start = time.perf_counter()
    result = await pool.run(HARNESS, stdin=job, timeout_s=harness_timeout_s(len(tests), timeout_s))
    details["sandbox_s"] = time.perf_counter() - start

    steps = {}
    results: list[dict[str, Any] | None] = [None] * len(tests)
    for line in result.stdout.splitlines():
        if not line.startswith(nonce + " "):
            continue  # cannot come from the candidate, which never sees the nonce or our stdout
        obj = json.loads(line[len(nonce) + 1:])
        if obj["step"] == "test":
            results[obj["i"]] = {k: obj[k] for k in ("ok", "error", "timed_out")}
        else:
            steps[obj["step"]] = obj
    missing = {"ok": False, "error": "not run", "timed_out": False}
    details["results"] = [r or missing for r in results]
    details["passed"] = sum(r["ok"] for r in details["results"])

    if "compile" not in steps:
        details.update(error="sandbox_error", message=f"harness gave no result: {result.stderr[-500:]}")
    elif not steps["compile"]["ok"]:
        details.update(error="syntax_error", message=steps["compile"]["error"])
    elif "load" not in steps or not steps["load"]["ok"]:
        load = steps.get("load", {"timed_out": True, "error": "harness killed"})
        details.update(error="timeout" if load["timed_out"] else "load_error", message=load["error"])
    elif any(r["timed_out"] for r in details["results"]) or result.timed_out:
        details.update(error="timeout", message="a test ran past its time limit")
    return details["passed"] / len(tests), details
