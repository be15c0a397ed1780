"""Run untrusted, model-written Python programs against test cases without letting them hurt anything.

Mechanism (why each layer exists):
  * `unshare --net --pid --fork --mount-proc --kill-child` (util-linux, needs root) gives every run an
    empty network namespace (no interface is up: even 127.0.0.1 is unreachable), its own PID namespace
    and a private mount namespace. The harness below is PID 1 in it; when PID 1 exits the kernel kills
    everything left in the namespace, which also catches children that escaped with setsid or a double
    fork (a process-group kill alone does not).
  * The harness (this file run as a script, trusted code, root inside the namespaces) mounts fresh
    tmpfs over /tmp and /dev/shm, so what a program writes vanishes with the namespace, and covers every
    top-level directory except the system ones (/usr, /etc, /dev, ...) with an empty tmpfs, binding only
    the Python installation back in, read-only: the repository, the datasets (which hold the expected
    outputs), /root, /home, /run and /var are not there to read. It then forks one child per test case.
    The child drops to the user `nobody` (uid 65534: RLIMIT_NPROC does not bind root), gets setrlimit
    limits (CPU seconds, address space, file size, open files, processes, no core files), an empty
    environment with HOME set to its private working dir, stdin from the test input, and its own output
    pipes. The harness enforces the per-case wall-clock deadline and the output cap (it reads at most N
    bytes, then kills), and after every case kills every other process in the namespace (kill(-1) from
    PID 1).
  * Verdicts come from outside the program. For stdin/stdout and call-based cases the harness forwards
    the program's output or JSON return value and the PARENT compares it with the expected answer, which
    never enters the sandbox. For check(candidate) test programs, whose asserts must run in the
    program's process, success is a per-case random nonce written on a separate pipe (fd 3) only after
    the test program returned; exiting early (os._exit(0), sys.exit), redefining print, closing stdout or
    printing "PASSED" cannot produce it. Return values handed to check() must be plain data (builtin
    containers and scalars), which stops "always equal" objects; a returned TreeNode / ListNode is rebuilt
    from its plain values with the harness's node class, and the test program gets the harness's own
    tree/list helpers, in its own copy of the globals. A program that digs the nonce out of its
    own memory could still forge it: this stops cheap reward hacks, not a determined in-process attacker.
  * The child cannot touch the harness: different uid (no ptrace, no signals), and PID 1 ignores
    signals from inside its namespace.
  * Without unshare (not root, or util-linux missing) runs fall back to: own session, privilege drop
    where root, the same rlimits, a subreaper harness that kills all descendants, a host temp dir as the
    working dir. There is NO network isolation then, /tmp is shared and everything `nobody` may read is
    visible; if Python lives where `nobody` cannot read, programs can import only the modules the harness
    preloaded. This fallback logs a warning on the "gapo.reward" logger and marks every result
    (`SandboxRun.isolated` False, RewardResult flag "unisolated"), so it can never go unnoticed.

Known limits: uid `nobody` is shared by concurrent runs, so a fork bomb in one run can exhaust the
process limit of another concurrent run for the bomb's lifetime (wall deadline). Memory is bounded per
process (RLIMIT_AS) times the process limit, not per run; run a cgroup around the trainer for a hard cap.
"""

from __future__ import annotations

import builtins
import collections
import json
import os
import resource
import selectors
import signal
import sys
import threading
import time
import traceback

# Everything above is all the harness needs at start-up; the host-only imports are below the harness.

NOBODY_UID = 65534
GUARD_NAME = "__gapo_guard__"
_EXIT_HARNESS_BUG = 121
_PATH = "/usr/local/bin:/usr/bin:/bin"

# Names LeetCode-style programs and tests use without importing them; only for call-based and
# check(candidate) cases, never for stdin/stdout programs, which are whole scripts. DeepCoder's harness (rllm,
# rllm/rewards/code_utils/utils.py: BASE_IMPORTS, run before every LeetCode program) defines a fixed set of
# explicit imports, and its data and the models trained on it rely on them (`xor` bare in a test, `deepcopy`,
# `re_search`, ...). This is that set, minus numpy and pandas (about 1 s of start-up on every run, for names
# LeetCode never provides), on top of the star imports of LeetCode's own judge. Like rllm we star-import neither
# operator nor math: their `pow` would shadow the builtin and break pow(a, b, mod).
# Its node classes and tree/list helpers are harness code below (_LEETCODE_NAMES), not prelude text.
PRELUDE = """\
from typing import *
from collections import *
from heapq import *
from bisect import *
from itertools import *
from functools import *
from string import *
from math import inf, gcd, lcm, comb, perm, sqrt, isqrt, log, log2, log10, ceil, floor, factorial, prod, pi, atan2
from copy import deepcopy
from operator import itemgetter, sub, xor, or_, iand
from random import randrange, shuffle
from re import search as re_search
from os.path import commonprefix
from time import time
import math, re, string, heapq, bisect, collections, itertools, functools, operator, random, sys
import copy, datetime, io, os
"""


_FALLBACK_MODULES = ("array", "copy", "dataclasses", "datetime", "decimal", "enum", "fractions", "io", "json",
                     "queue", "statistics", "struct", "unicodedata")


# ==================================================================================================
# Harness: runs as PID 1 inside the namespaces (or as a plain subreaper process in the fallback).
# ==================================================================================================
def _harness_main() -> None:
    job = json.loads(_read_fd(0))
    os.umask(0o022)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if job["isolated"]:
        workdir = _private_filesystem(job["limits"]["tmpfs_mb"], job["drop_uid"])
    else:
        workdir = os.getcwd()
        _set_child_subreaper()
        # No mount namespace to expose the interpreter in: if it lives where `nobody` cannot read (pyenv
        # under /root), programs can only use modules imported here, so import the usual ones.
        for name in _FALLBACK_MODULES:
            __import__(name)
    exec(PRELUDE, {})  # import once here so each forked child starts with the modules loaded
    for index, case in enumerate(job["cases"]):
        outcome = _run_case(job, case, workdir)
        outcome["i"] = index
        _write_all(1, (json.dumps(outcome, ensure_ascii=False) + "\n").encode("utf-8", "surrogateescape"))
    _write_all(1, b'{"done": true}\n')
    os._exit(0)


def _read_fd(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC = 1, 2, 4, 32, 4096, 16384
_MNT_DETACH = 2


def _mount(source: str, target: str, fstype: str | None, flags: int, options: str | None = None) -> None:
    import ctypes

    encoded = options.encode() if options is not None else None
    if _libc().mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags, encoded) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} on {target} failed: {os.strerror(errno)}")


# Top-level directories a program may see; every other one (the repository, datasets that hold the
# expected outputs, /root, /home, /mnt, /opt, /run, /var, ...) is covered by an empty tmpfs.
_SYSTEM_DIRS = frozenset({"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "sys", "tmp", "usr"})


def _private_filesystem(tmpfs_mb: int, uid: int | None) -> str:
    """In our private mount namespace: fresh tmpfs on the world-writable /tmp and /dev/shm (nothing a
    program writes outlives the run), and nothing readable beyond the system directories and Python."""
    for target in ("/tmp", "/dev/shm"):
        _mount("tmpfs", target, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={int(tmpfs_mb)}m,mode=1777")
    covers = [f"/{name}" for name in os.listdir("/")
              if name not in _SYSTEM_DIRS and os.path.isdir(f"/{name}") and not os.path.islink(f"/{name}")]
    _cover_except_python(covers)
    workdir = "/tmp/work"
    os.mkdir(workdir, 0o700)
    if uid is not None:
        os.chown(workdir, uid, uid)
    return workdir


def _cover_except_python(covers: list[str]) -> None:
    """Cover each directory in `covers` with an empty tmpfs, then bind the Python installation (base
    prefix, venv, sys.path entries) back in, read-only, at its own path. The same is done for a directory
    that `nobody` may not traverse on the way to Python (pyenv under /root, mode 700), without which the
    program could import nothing the harness had not imported already."""
    wanted = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, *sys.path) if p and os.path.isdir(p)}
    tops = sorted(p for p in wanted if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in wanted))
    groups: dict[str, list[str]] = {cover: [] for cover in covers}
    for path in tops:
        cover = next((c for c in covers if path.startswith(c + "/")), None) or _first_closed_ancestor(path)
        if cover is not None:
            groups.setdefault(cover, []).append(path)
    for i, (cover, paths) in enumerate(groups.items()):
        staged = []
        for j, path in enumerate(paths):
            stage = f"/tmp/.stage-{i}-{j}"
            os.mkdir(stage, 0o700)
            _mount(path, stage, None, _MS_BIND | _MS_REC)
            staged.append((stage, path))
        _mount("tmpfs", cover, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
        for stage, path in staged:
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(stage, path, None, _MS_BIND | _MS_REC)
            _mount("none", path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY)
            if _libc().umount2(stage.encode(), _MNT_DETACH) != 0:
                raise OSError(f"unmounting the staging bind {stage} failed")
            os.rmdir(stage)


def _first_closed_ancestor(path: str) -> str | None:
    """The top-most proper ancestor of `path` that others may not traverse (no o+x), if any."""
    parts = path.strip("/").split("/")[:-1]
    current = ""
    for part in parts:
        current += "/" + part
        if not os.stat(current).st_mode & 0o001:
            return current
    return None


def _set_child_subreaper() -> None:
    """Fallback mode: orphaned descendants are re-parented to the harness, so it can find and kill them."""
    pr_set_child_subreaper = 36
    if _libc().prctl(pr_set_child_subreaper, 1, 0, 0, 0) != 0:
        raise OSError("prctl(PR_SET_CHILD_SUBREAPER) failed")


def _run_case(job: dict, case: dict, workdir: str) -> dict:
    limits = job["limits"]
    stdin_fd = _stdin_for(case)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    res_r, res_w = os.pipe()
    nonce = os.urandom(16).hex() if case["kind"] == "check" else ""
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child never returns into the harness loop
        try:
            _child(job, case, workdir, stdin_fd, out_w, err_w, res_w, nonce)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(_EXIT_HARNESS_BUG)
    for fd in (stdin_fd, out_w, err_w, res_w):
        os.close(fd)
    state, buffers = _watch(pid, (out_r, err_r, res_r), start + limits["wall_s"], limits["max_output_bytes"])
    wait_status, cpu_used = _kill_all_descendants(pid, job["isolated"])
    for fd in (out_r, err_r, res_r):
        _drain(fd, buffers[fd], limits["max_output_bytes"])
        os.close(fd)
    wall = time.monotonic() - start
    exit_code = os.waitstatus_to_exitcode(wait_status) if wait_status is not None else None
    stdout = bytes(buffers[out_r]).decode("utf-8", "replace")
    stderr = bytes(buffers[err_r][-4000:]).decode("utf-8", "replace")
    result = bytes(buffers[res_r]).decode("utf-8", "replace")
    out_of_cpu = cpu_used >= limits["cpu_s"] - 0.05
    status = state or _status_from_exit(case, exit_code, out_of_cpu, result, nonce)
    outcome = {"status": status, "exit_code": exit_code, "stderr": stderr, "wall_s": round(wall, 4)}
    if case["kind"] == "stdio":
        outcome["stdout"] = stdout
    elif case["kind"] == "call" and status == "ok":
        outcome["value"] = result
    return outcome


def _status_from_exit(case: dict, exit_code: int | None, out_of_cpu: bool, result: str, nonce: str) -> str:
    if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and out_of_cpu):
        return "timeout"  # CPU soft limit (SIGXCPU) or, if the program caught that, the hard limit
    if case["kind"] == "check":
        return "ok" if result == nonce else "error"
    if case["kind"] == "call":
        return "ok" if exit_code == 0 and result else "error"
    return "ok" if exit_code == 0 else "error"


def _stdin_for(case: dict) -> int:
    if case["kind"] != "stdio":
        return os.open(os.devnull, os.O_RDONLY)
    fd = os.memfd_create("stdin")
    _write_all(fd, case["stdin"].encode("utf-8", "surrogateescape"))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _watch(pid: int, fds: tuple[int, ...], deadline: float, cap: int) -> tuple[str | None, dict[int, bytearray]]:
    """Collect output until the child exits, the deadline passes or the output cap is hit."""
    buffers = {fd: bytearray() for fd in fds}
    pidfd = os.pidfd_open(pid)
    selector = selectors.DefaultSelector()
    for fd in fds:
        selector.register(fd, selectors.EVENT_READ)
    selector.register(pidfd, selectors.EVENT_READ)
    state = None
    total = 0
    exited = False
    try:
        while not exited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                state = "timeout"
                break
            for key, _ in selector.select(remaining):
                if key.fd == pidfd:
                    exited = True
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                total += len(chunk)
                buffers[key.fd] += chunk
                if total > cap:
                    state = "output_limit"
                    exited = True
                    break
    finally:
        selector.close()
        os.close(pidfd)
    return state, buffers


def _drain(fd: int, buffer: bytearray, cap: int) -> None:
    """What is left in a pipe once every writer is dead; non-blocking, so a surviving writer cannot stall us."""
    os.set_blocking(fd, False)
    while len(buffer) <= cap:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not chunk:
            return
        buffer += chunk


def _kill_all_descendants(child: int, isolated: bool) -> tuple[int | None, float]:
    """Kill the case's child and everything it started; return the child's wait status and CPU seconds."""
    child_status, child_cpu = None, 0.0
    while True:
        if isolated:
            _kill_everyone_else()
        else:
            for pid in _my_children():
                _kill_quietly(pid)
        try:
            pid, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            return child_status, child_cpu
        if pid == child:
            child_status, child_cpu = status, usage.ru_utime + usage.ru_stime


def _kill_everyone_else() -> bool:
    """From PID 1 of a namespace, kill(-1) reaches every other process in it, and only those."""
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        return False  # nothing left to signal
    return True


def _kill_quietly(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False  # exited between listing and killing
    return True


def _my_children() -> list[int]:
    me = os.getpid()
    with open(f"/proc/{me}/task/{me}/children") as f:
        return [int(p) for p in f.read().split()]


# --------------------------------------------------------------------------------------------------
# Inside the forked child: become unprivileged, then run the program.
# --------------------------------------------------------------------------------------------------
def _child(job: dict, case: dict, workdir: str, stdin_fd: int, out_w: int, err_w: int, res_w: int,
           nonce: str) -> None:
    os.setsid()
    os.dup2(stdin_fd, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.dup2(res_w, 3)
    os.closerange(4, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    limits = job["limits"]
    memory = limits["memory_mb"] << 20
    cpu = max(1, int(-(-limits["cpu_s"] // 1)))
    file_size = limits["max_file_mb"] << 20
    for which, value in (
        (resource.RLIMIT_AS, (memory, memory)),
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_FSIZE, (file_size, file_size)),
        (resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2),
        (resource.RLIMIT_NPROC, (limits["max_processes"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(which, value)
    uid = job["drop_uid"]
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    os.chdir(workdir)
    os.umask(0o077)
    os.environ.clear()
    os.environ.update({"PATH": _PATH, "HOME": workdir, "TMPDIR": "/tmp", "LANG": "C.UTF-8"})
    sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", errors="surrogateescape", closefd=False)
    out = sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", errors="surrogateescape", closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
    sys.argv = ["solution.py"]
    write_result, exit_now = os.write, os._exit  # the program may overwrite os.*; keep our own references

    kind = case["kind"]
    if kind == "stdio":
        exit_code = 0
        try:
            code = compile(job["program"], "solution.py", "exec")
            exec(code, {"__name__": "__main__", "__builtins__": builtins, "__file__": "solution.py"})
            _join_other_threads()
        except SystemExit as exc:
            exit_code = _exit_code(exc)
        except BaseException:
            traceback.print_exc()
            exit_code = 1
        _flush(out, sys.stdout, sys.stderr)
        exit_now(exit_code)

    sys.setrecursionlimit(50_000)
    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(PRELUDE, namespace)
        namespace.update(_LEETCODE_NAMES)
        exec(compile(job["program"], "solution.py", "exec"), namespace)
        if kind == "call":
            value = _plain(_resolve(namespace, case["fn_name"])(*case["args"]))
            payload = json.dumps(value).encode()
        else:
            # The test program runs in a copy of the globals with the harness's helpers put back: a program
            # that rebinds is_same_tree & co., when defined or while it runs, cannot change what the asserts call.
            tests = {**namespace, **_LEETCODE_NAMES, GUARD_NAME: _guard}
            exec(compile(case["program"], "tests.py", "exec"), tests)
            if case.get("entry_point"):
                tests["check"](_guard(tests[case["entry_point"]]))
            payload = nonce.encode()
    except BaseException:  # SystemExit included: leaving early is a failure for these kinds
        traceback.print_exc()
        _flush(out, sys.stdout, sys.stderr)
        exit_now(1)
    _flush(out, sys.stdout, sys.stderr)
    view = memoryview(payload)
    while view:
        view = view[write_result(3, view) :]
    exit_now(0)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _join_other_threads() -> None:
    """Python waits for non-daemon threads before exiting (the common `threading.Thread(target=main)`
    trick for deep recursion relies on it), so do the same; the wall deadline bounds the wait."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()


def _flush(*streams: object) -> None:
    for stream in streams:
        flush = getattr(stream, "flush", None)
        if flush is None or getattr(stream, "closed", False):
            continue
        try:
            flush()
        except (OSError, ValueError) as exc:  # the program broke its own stream; record it, go on
            os.write(2, f"[sandbox] flushing output failed: {exc!r}\n".encode())


def _resolve(namespace: dict, fn_name: str):
    solution = namespace.get("Solution")
    if isinstance(solution, type) and hasattr(solution, fn_name):
        return getattr(solution(), fn_name)
    if fn_name in namespace and callable(namespace[fn_name]):
        return namespace[fn_name]
    raise NameError(f"the program defines no function or Solution method named {fn_name!r}")


def _plain_types() -> frozenset[type]:
    import decimal
    import fractions

    return frozenset({int, float, bool, str, bytes, type(None), complex, list, tuple, dict, set, frozenset,
                      collections.Counter, collections.OrderedDict, collections.defaultdict, collections.deque,
                      decimal.Decimal, fractions.Fraction})


_PLAIN_TYPES = _plain_types()


def _plain(value: object) -> object:
    """Return `value` if it is plain data all the way down, else raise. Objects of program-defined classes
    could override __eq__ to compare equal to anything."""
    stack, seen = [value], set()
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind not in _PLAIN_TYPES:
            raise TypeError(f"the solution returned a {kind.__name__!r} object; only plain data is accepted")
        if isinstance(item, str | bytes) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset | collections.deque):
            stack.extend(item)
    return value


def _guard(candidate):
    """What a check(candidate) program gets instead of the program's own callable."""

    def guarded(*args, **kwargs):
        return _returned(candidate(*args, **kwargs))

    return guarded


def _returned(value: object) -> object:
    """Plain data, or the LeetCode linked shapes: a TreeNode or ListNode (whatever class the program used),
    alone or in a list, comes back rebuilt from its plain values with the harness's own node class, so no
    program-defined __eq__ or property reaches the asserts."""
    if type(value).__name__ in _NODE_FIELDS:
        return _rebuilt(value)
    if type(value) is list and any(type(item).__name__ in _NODE_FIELDS for item in value):
        return [_returned(item) for item in value]
    return _plain(value)


# --------------------------------------------------------------------------------------------------
# LeetCode's linked structures, with the names and semantics of DeepCoder's harness (rllm, utils.py:
# BASE_LEETCODE_IMPORTS), whose tests build inputs with tree_node / list_node and compare results with
# is_same_tree / is_same_list. Trusted code: the test program always gets these (see _child), and they read
# and build the harness's nodes through each class's own instance-dict descriptor, taken here, so a program
# that patches TreeNode or ListNode (a property for `val`, a new __init__) changes neither the expected
# structures nor what is compared. Iterative, as LeetCode lists and degenerate trees run 10^5 nodes deep.
# --------------------------------------------------------------------------------------------------
class ListNode:
    def __init__(self, val=0, next=None):
        self.val = val
        self.next = next


class TreeNode:
    def __init__(self, val=0, left=None, right=None):
        self.val = val
        self.left = left
        self.right = right


_NODE_FIELDS = {"ListNode": ("val", "next"), "TreeNode": ("val", "left", "right")}
_NODE_DICT = {cls: cls.__dict__["__dict__"] for cls in (ListNode, TreeNode)}


def _new_node(cls: type, **fields: object) -> object:
    node = object.__new__(cls)
    _NODE_DICT[cls].__get__(node).update(fields)
    return node


def _fields(node: object, names: tuple[str, ...]) -> list:
    """Each field read once: from the instance dict for the harness's nodes, else as the program answers it."""
    descriptor = _NODE_DICT.get(type(node))
    if descriptor is not None:
        instance = descriptor.__get__(node)
        return [instance[name] for name in names]
    return [getattr(node, name) for name in names]


def list_node(values: list) -> ListNode | None:
    """A linked list holding `values`; None for an empty list."""
    head = None
    for value in reversed(values):
        head = _new_node(ListNode, val=value, next=head)
    return head


def tree_node(values: list) -> TreeNode | None:
    """A binary tree from LeetCode's level order with None for missing children. Like rllm's: the root is
    values[0] even when that is None, and values left over once no parent is waiting are ignored."""
    if not values:
        return None
    root = _new_node(TreeNode, val=values[0], left=None, right=None)
    parents, i = collections.deque([root]), 1
    while parents and i < len(values):
        parent = _NODE_DICT[TreeNode].__get__(parents.popleft())
        for side in ("left", "right"):
            if i < len(values) and values[i] is not None:
                parent[side] = _new_node(TreeNode, val=values[i], left=None, right=None)
                parents.append(parent[side])
            i += 1
    return root


def _list_values(head: object) -> list:
    """The values along a list, which must be plain data; a cycle is an error (rllm would loop forever)."""
    values, seen = [], {}
    while head is not None:
        if id(head) in seen:
            raise ValueError("the linked list has a cycle")
        seen[id(head)] = head  # kept alive, so no id is reused while we walk
        value, head = _fields(head, _NODE_FIELDS["ListNode"])
        values.append(value)
    return _plain(values)


def _tree_values(root: object) -> list:
    """Preorder: (val,) per node, None per missing child; two trees are the same iff these are equal.
    Shared subtrees are fine (memoised solutions return them), a cycle is an error."""
    values, on_path, stack = [], set(), [(False, root)]
    while stack:
        leaving, node = stack.pop()
        if leaving:
            on_path.discard(id(node))
        elif node is None:
            values.append(None)
        elif id(node) in on_path:
            raise ValueError("the tree has a cycle")
        else:
            on_path.add(id(node))
            val, left, right = _fields(node, _NODE_FIELDS["TreeNode"])
            values.append((val,))
            stack += [(True, node), (False, right), (False, left)]
    return _plain(values)


def _rebuilt(node: object) -> object:
    if type(node).__name__ == "ListNode":
        return list_node(_list_values(node))
    values = _tree_values(node)
    holder = _new_node(TreeNode, val=None, left=None, right=None)
    slots = [(holder, "left")]  # where the next preorder item goes, innermost last
    for item in values:
        parent, side = slots.pop()
        if item is not None:
            child = _new_node(TreeNode, val=item[0], left=None, right=None)
            _NODE_DICT[TreeNode].__get__(parent)[side] = child
            slots += [(child, "right"), (child, "left")]
    return _NODE_DICT[TreeNode].__get__(holder)["left"]


def is_same_list(l1: object, l2: object) -> bool:
    return _list_values(l1) == _list_values(l2)


def is_same_tree(p: object, q: object) -> bool:
    return _tree_values(p) == _tree_values(q)


_LEETCODE_NAMES = {"ListNode": ListNode, "TreeNode": TreeNode, "list_node": list_node, "tree_node": tree_node,
                   "is_same_list": is_same_list, "is_same_tree": is_same_tree}


# Run as a script, this file is the harness. It starts here, before the host-only imports below, which the
# harness does not need (saves start-up time on every run); _harness_main never returns.
if __name__ == "__main__":
    _harness_main()


# ==================================================================================================
# Host side: start the harness, stream its per-case outcomes, enforce the backstop deadline.
# ==================================================================================================
import atexit  # noqa: E402 - host-only imports, kept out of the harness's start-up path
import functools  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402

logger = logging.getLogger("gapo.reward")

_UNSHARE_ARGS = ("--net", "--pid", "--fork", "--mount-proc", "--kill-child")
# Time for unshare + interpreter start + prelude imports, on top of the per-case budgets.
_STARTUP_ALLOWANCE_S = 10.0


@dataclass(frozen=True)
class Limits:
    """Per-case limits. `wall_s` is the wall-clock budget of ONE case (one execution of the program)."""

    wall_s: float = 10.0
    cpu_s: float | None = None  # default: the wall budget
    memory_mb: int = 1024
    max_output_bytes: int = 4 << 20
    max_processes: int = 32
    max_open_files: int = 64
    max_file_mb: int = 16
    tmpfs_mb: int = 64

    def __post_init__(self) -> None:
        for name in ("wall_s", "memory_mb", "max_output_bytes", "max_processes", "max_open_files",
                     "max_file_mb", "tmpfs_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class StdioCase:
    """Run the program as a script with `stdin` as its standard input; its stdout is compared outside."""

    stdin: str
    kind: str = field(default="stdio", init=False)


@dataclass(frozen=True)
class CallCase:
    """Call `fn_name` (a function, or a method of class Solution) with `args`; its JSON value is compared outside."""

    fn_name: str
    args: list
    kind: str = field(default="call", init=False)


@dataclass(frozen=True)
class CheckCase:
    """Run a test `program` after the solution (and `check(entry_point)` if given); passing = no exception."""

    program: str
    entry_point: str | None = None
    kind: str = field(default="check", init=False)


Case = StdioCase | CallCase | CheckCase


@dataclass(frozen=True)
class CaseOutcome:
    """What one case did. status: "ok" (ran to completion; for check cases: passed), "error" (exception,
    non-zero exit, killed, failed assertion), "timeout", "output_limit"."""

    status: str
    exit_code: int | None
    stderr: str
    wall_s: float
    stdout: str | None = None
    value: str | None = None


@dataclass(frozen=True)
class SandboxRun:
    """The outcomes in case order (fewer than the cases when stopped early), and how the run went:
    `error` is set when the sandbox itself failed (not the program), `isolated` is False in the fallback."""

    outcomes: tuple[CaseOutcome, ...]
    isolated: bool
    error: str | None
    wall_s: float


@functools.cache
def namespaces_available() -> bool:
    """Whether unshare-based isolation works here (probed once per process)."""
    exe = shutil.which("unshare")
    if exe is None:
        logger.warning("sandbox: `unshare` (util-linux) not found")
        return False
    if os.geteuid() != 0:
        logger.warning("sandbox: not running as root, cannot create network/PID namespaces")
        return False
    probe = subprocess.run([exe, *_UNSHARE_ARGS, "--", "true"], capture_output=True, timeout=30, check=False)
    if probe.returncode != 0:
        logger.warning("sandbox: unshare probe failed (%d): %s", probe.returncode, probe.stderr[-300:])
    return probe.returncode == 0


_warned_unisolated = False


def _warn_unisolated() -> None:
    global _warned_unisolated
    if not _warned_unisolated:
        _warned_unisolated = True
        logger.warning(
            "SANDBOX NOT ISOLATED: running untrusted code without network/PID/mount namespaces. "
            "Programs can reach the network, write to the shared /tmp and leave setsid escapees. "
            "Results carry the 'unisolated' flag. Run as root with util-linux `unshare` to fix this."
        )


_RUNNING: set[subprocess.Popen] = set()
_RUNNING_LOCK = threading.Lock()


def run_program(
    program: str,
    cases: Sequence[Case],
    limits: Limits | None = None,
    *,
    stop_after: Callable[[int, CaseOutcome], bool] | None = None,
    isolation: str = "auto",
) -> SandboxRun:
    """Run `program` on each case in order, in one sandbox. `stop_after(i, outcome)` returning True ends
    the run right away (the caller compares outputs and stops at the first failure).
    `isolation`: "auto" (namespaces when available, else the loud fallback), "namespaces" or "none"."""
    limits = limits or Limits()
    if isolation not in ("auto", "namespaces", "none"):
        raise ValueError(f"isolation must be 'auto', 'namespaces' or 'none', got {isolation!r}")
    if not isinstance(program, str):
        raise TypeError(f"program: expected str, got {type(program).__name__}")
    if not cases:
        raise ValueError("cases: at least one case is required")
    isolated = namespaces_available() if isolation == "auto" else isolation == "namespaces"
    if not isolated:
        _warn_unisolated()
    root = os.geteuid() == 0
    job = {
        "program": program,
        "cases": [asdict(c) for c in cases],
        "limits": {**asdict(limits), "cpu_s": limits.cpu_s or limits.wall_s},
        "isolated": isolated,
        "drop_uid": NOBODY_UID if root else None,
    }
    start = time.monotonic()
    workdir = None if isolated else _host_workdir(root)
    try:
        with tempfile.TemporaryFile() as job_file:
            job_file.write(json.dumps(job).encode("utf-8", "surrogateescape"))
            job_file.seek(0)
            outcomes, error = _supervise(job_file, workdir, isolated, len(cases), limits, stop_after)
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=False)
    return SandboxRun(tuple(outcomes), isolated, error, time.monotonic() - start)


def _host_workdir(root: bool) -> str:
    workdir = tempfile.mkdtemp(prefix="gapo-sandbox-")
    if root:
        os.chown(workdir, NOBODY_UID, NOBODY_UID)
    return workdir


def _supervise(job_file, workdir: str | None, isolated: bool, n_cases: int, limits: Limits,
               stop_after: Callable[[int, CaseOutcome], bool] | None) -> tuple[list[CaseOutcome], str | None]:
    harness = [sys.executable, "-I", "-B", os.path.abspath(__file__)]
    argv = [shutil.which("unshare") or "unshare", *_UNSHARE_ARGS, "--", *harness] if isolated else harness
    proc = subprocess.Popen(
        argv,
        stdin=job_file,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"PATH": _PATH, "LANG": "C.UTF-8"},
        cwd=workdir or "/",
        start_new_session=True,
    )
    with _RUNNING_LOCK:
        _RUNNING.add(proc)
    outcomes: list[CaseOutcome] = []
    error = None
    budget = _STARTUP_ALLOWANCE_S + n_cases * (limits.wall_s + 1.0)
    deadline = time.monotonic() + budget
    line_cap = 8 * limits.max_output_bytes + 65536
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    selector.register(proc.stderr, selectors.EVENT_READ)
    pending, stderr_tail, done = b"", b"", False
    try:
        while not done and error is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                error = f"sandbox backstop deadline ({budget:.0f}s) exceeded"
                break
            events = selector.select(remaining)
            for key, _ in events:
                chunk = os.read(key.fd, 1 << 20)
                if key.fileobj is proc.stderr:
                    stderr_tail = (stderr_tail + chunk)[-4000:]
                    if not chunk:
                        selector.unregister(proc.stderr)
                    continue
                if not chunk:
                    error = f"sandbox harness ended without finishing (exit code {proc.wait()}): " + \
                        stderr_tail.decode("utf-8", "replace")[-1500:]
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                if len(pending) > line_cap:
                    error = "sandbox harness sent an oversized record"
                    break
                for line in lines:
                    record = json.loads(line)
                    if record.get("done"):
                        done = True
                        break
                    index = record.pop("i")
                    outcome = CaseOutcome(**record)
                    outcomes.append(outcome)
                    if stop_after is not None and stop_after(index, outcome):
                        done = True
                        break
    finally:
        selector.close()
        _terminate(proc, isolated)
        with _RUNNING_LOCK:
            _RUNNING.discard(proc)
    return outcomes, error


def _terminate(proc: subprocess.Popen, isolated: bool) -> None:
    """Kill the harness first and let unshare reap it: killing unshare first would orphan the harness to
    the machine's init, which in a container may never reap it (a zombie left behind)."""
    if proc.poll() is None:
        if isolated:
            try:
                with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                    harness_pids = [int(p) for p in f.read().split()]
            except FileNotFoundError:
                harness_pids = []  # unshare already gone
            for pid in harness_pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                logger.warning("sandbox: unshare did not exit after its child was killed; killing its group")
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                logger.debug("sandbox process group already gone")
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()


@atexit.register
def _kill_running_sandboxes() -> None:
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for proc in running:
        _terminate(proc, isolated=True)

