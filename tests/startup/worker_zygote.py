"""Ray's Python workers of the test suite, forked from one process that has imported torch, transformers and
DeepSpeed already, instead of each importing them afresh.

Every actor and training worker of every fit is a new Python process (Ray never hands an actor a pooled
one), and much of what it spends before its first call is imports: ~3.5 of the ~4 CPU-s of ``import
torch, transformers, deepspeed, pandas`` in a training worker, ~1 s of every controller's, and numpy,
pandas and pyarrow in every other actor (docs/suite-time.md). The suite starts a few hundred of them on two
cores. The product does not ship this: it changes how the suite's worker processes come to exist, not what
they run.

How: conftest.py starts ``python worker_zygote.py SOCKET`` (the *zygote*) and puts SOCKET in
``HYMT_TEST_WORKER_ZYGOTE``, which every Ray the suite starts passes on to its workers. When a raylet execs
``python default_worker.py ARGS``, sitecustomize.py calls ``start_in_zygote()`` before Ray's code: that
process (the *stand-in*) sends its argv, environment, ``sys.path``, cwd and standard streams to the zygote,
which forks a child that takes them on and runs ``default_worker.py`` as ``__main__``. The child registers
with Ray under its own pid, in a process group of its own as the raylet gives a worker, so that is the
process Ray and the tests signal and kill. The stand-in forwards the signals it gets to the child and ends
as the child ended; the zygote kills a child whose stand-in was killed.

The zygote imports no Ray. Ray's C++ side keeps state from import on: its config reads the job id and the
raylet's pid from the environment once per process, and with Ray imported before the fork (a zygote per
raylet, tried on 2026-12-07) an asyncio actor's worker failed Ray's check ``erased == 1`` in
``CoreWorker::ExecuteTask`` at its first task (the DatasetManager of a fit that splits a dataset).

A zygote declines, and the worker starts as usual, when the worker's environment differs from the
zygote's in a variable outside ``_PER_WORKER`` (the libraries read some once, at import), when its
interpreter differs (another venv), when a folder put first on its ``sys.path`` (PYTHONPATH, a job's
working_dir) holds a module the zygote imported, or when its standard streams are not all open. A worker
that finds no zygote starts as usual too. ``SOCKET.log`` lists every fork, exit (with the child's CPU-s)
and decline.
"""

from __future__ import annotations

import array
import os
import pickle
import signal
import socket
import struct
import sys

#: Variables (names, or prefixes) a worker's environment may hold with other values than the zygote's: Ray's
#: and MLflow's (the zygote imports neither), ours, and those read only when used (inductor's cache folder,
#: torch's CUDA check and process groups, setproctitle's first call, S3 clients, Tune's note to Lightning,
#: ``breakpoint()``, the terminal's size, pytest's current test, the shell's PATH and folders). PYTHONPATH's
#: effect, ``sys.path``, is compared by itself.
_PER_WORKER = ("RAY_", "MLFLOW_", "HYMT_", "AWS_", "NCCL_", "PYTHONPATH", "OMP_NUM_THREADS",
               "CUDA_VISIBLE_DEVICES", "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK", "SPT_NOENV",
               "PL_DISABLE_FORK", "PYTHONBREAKPOINT", "COLUMNS", "LINES", "PYTEST_CURRENT_TEST", "PATH", "PWD",
               "OLDPWD", "SHLVL", "_")
#: The signals a stand-in passes on to its child.
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_INT = struct.Struct("!i")


def start_in_zygote() -> None:
    """Runs this worker process in a child of the zygote and exits as that child exits; returns (and the
    worker starts as usual) when there is no zygote or it declines."""
    path = os.environ.get("HYMT_TEST_WORKER_ZYGOTE")
    if not path:
        return
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        for fd in (0, 1, 2):
            os.fstat(fd)
        conn.connect(path)
        request = pickle.dumps({
            "argv": sys.argv,
            "env": dict(os.environ),
            "path": sys.path,  # as it is before Python puts the script's folder first
            "cwd": os.getcwd(),
            "executable": sys.executable,
            "write_through": getattr(sys.stdout, "write_through", False),
        })
        fds = array.array("i", [0, 1, 2])
        conn.sendmsg([_INT.pack(len(request)) + request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        pid = _read_int(conn)
    except OSError:
        pid = None
    if not pid:  # declined, unreachable, or gone before it forked
        conn.close()
        return

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in _FORWARDED:
        signal.signal(signum, forward)
    status = _read_int(conn)
    if status is None:  # the zygote died, so the child cannot be waited for
        forward(signal.SIGKILL, None)
        os._exit(1)
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _read_int(conn: socket.socket) -> int | None:
    data = b""
    while len(data) < _INT.size:
        try:
            chunk = conn.recv(_INT.size - len(data))
        except OSError:  # reset: the other side is gone, as when it closed
            return None
        if not chunk:
            return None
        data += chunk
    return _INT.unpack(data)[0]


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    head, ancdata, _flags, _addr = conn.recvmsg(_INT.size, socket.CMSG_SPACE(3 * _INT.size))
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if len(head) < _INT.size:  # a stand-in killed before it sent its request
        raise EOFError("the stand-in closed before its request")
    (size,) = _INT.unpack(head)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise EOFError("the stand-in closed its request")
        body += chunk
    return pickle.loads(body), list(fds)


def _declines(request: dict, env: dict[str, str], search_path: list[str], imported: set[str]) -> str | None:
    """Why the zygote cannot stand for the process of ``request``, or None when it can. ``imported`` holds
    the top-level names of the modules the zygote has imported."""
    if request["executable"] != sys.executable:
        return f"another interpreter: {request['executable']}"
    extra = request["path"][: len(request["path"]) - len(search_path)]
    if request["path"][len(extra):] != search_path:
        return f"another sys.path: {request['path']}"
    hidden = _hidden(extra, imported)
    if hidden:
        return hidden
    theirs = request["env"]
    differing = sorted(
        key for key in env.keys() | theirs.keys() if env.get(key) != theirs.get(key) and not key.startswith(_PER_WORKER)
    )
    return f"{', '.join(differing)} differ" if differing else None


def _hidden(folders: list[str], imported: set[str]) -> str | None:
    """What folders put before the zygote's own (PYTHONPATH, a job's working_dir) hold of the modules the
    zygote imported: the worker would have imported theirs."""
    for folder in folders:
        try:
            names = {name.removesuffix(".py") for name in os.listdir(folder)}
        except OSError:
            continue
        if names & imported:
            return f"{folder} holds {sorted(names & imported)}"
    return None


def serve(path: str, search_path: list[str], env: dict[str, str]) -> dict:
    """Forks a child per request and tells each stand-in how its child ended. Returns only in a child, with
    the request it is to run; exits when the process that started it has ended."""
    import selectors

    set_by_imports = {k: v for k, v in os.environ.items() if k not in env}
    imported = {name.partition(".")[0] for name in sys.modules}
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}  # pid -> its stand-in's connection
    log = open(path + ".log", "a", buffering=1)
    while os.getppid() == parent:
        for key, _ in selector.select(timeout=0.1):
            if key.fileobj is not listener:  # a stand-in's connection reads only at its end: it was killed
                if not key.fileobj.recv(1):
                    selector.unregister(key.fileobj)
                    _kill(next(pid for pid, conn in children.items() if conn is key.fileobj))
                continue
            conn, _ = listener.accept()
            try:
                request, fds = _recv_request(conn)
            except (OSError, EOFError, pickle.UnpicklingError) as e:
                log.write(f"unreadable request: {e!r}\n")
                conn.close()
                continue
            reason = _declines(request, env, search_path, imported)
            if reason:
                log.write(f"declined {request['argv'][0]}: {reason}\n")
                _send(conn, 0)
            else:
                pid = os.fork()
                if pid == 0:
                    for other in (listener, log, *children.values()):
                        other.close()
                    selector.close()
                    _take_on(request, fds, conn, set_by_imports)
                    return request
                log.write(f"forked {pid}\n")
                children[pid] = conn
                selector.register(conn, selectors.EVENT_READ)
                _send(conn, pid)
            for fd in fds:
                os.close(fd)
            if reason:
                conn.close()
        while children:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            log.write(f"exit {pid} {status} {usage.ru_utime + usage.ru_stime:.2f}\n")
            conn = children.pop(pid)
            try:
                selector.unregister(conn)
            except KeyError:  # unregistered when its stand-in was killed
                pass
            _send(conn, status)
            conn.close()
    for pid in children:
        _kill(pid)
    os._exit(0)


def _send(conn: socket.socket, value: int) -> None:
    try:
        conn.sendall(_INT.pack(value))
    except OSError:  # the stand-in is gone (its child, if any, is killed when its connection reads empty)
        pass


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _take_on(request: dict, fds: list[int], conn: socket.socket, set_by_imports: dict[str, str]) -> None:
    """Makes this forked child the process its stand-in would have become."""
    import io
    import random

    os.setpgid(0, 0)  # a group of its own, as the raylet gives each worker: Ray may end a worker's group
    for signum in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    conn.close()
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding=sys.stdin.encoding)
    stdout = io.FileIO(1, "w", closefd=False)
    sys.stdout = io.TextIOWrapper(stdout if request["write_through"] else io.BufferedWriter(stdout),
                                  encoding=sys.stdout.encoding, write_through=request["write_through"])
    sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding=sys.stderr.encoding,
                                  errors="backslashreplace", line_buffering=True)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in set_by_imports.items():  # as the imports would have set them in the stand-in
        os.environ.setdefault(key, value)
    sys.argv = list(request["argv"])
    sys.path[:] = [os.path.dirname(os.path.realpath(sys.argv[0])), *request["path"]]
    _size_torch_threads_as_a_fresh_process(request["env"])
    random.seed()  # every child would otherwise draw what its siblings draw
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _size_torch_threads_as_a_fresh_process(env: dict[str, str]) -> None:
    """A fresh process's torch takes its thread count from OMP_NUM_THREADS as it is when torch is imported,
    which in a Ray worker is after Ray has set it for the worker's CPUs (at its first task, when unset). In
    the zygote torch was imported with the zygote's: the child sets the count from its own variable now,
    or when Ray sets it."""
    import torch

    if env.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        return
    environ = type(os.environ)
    setitem = environ.__setitem__

    def set_and_size(self, key, value):
        setitem(self, key, value)
        if key == "OMP_NUM_THREADS" and self is os.environ:
            environ.__setitem__ = setitem
            torch.set_num_threads(int(value))

    environ.__setitem__ = set_and_size


def _import_what_workers_import() -> None:
    import deepspeed  # noqa: F401
    import numpy  # noqa: F401
    import pandas  # noqa: F401
    import pyarrow  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    assert "ray" not in sys.modules, "the zygote must not import Ray (see the module's docstring)"


if __name__ == "__main__":
    search_path = sys.path[1:]  # without this script's folder, as a stand-in's is
    env = dict(os.environ)  # as a stand-in's is, before the imports set their own
    _import_what_workers_import()
    socket_path = sys.argv[1]
    try:
        request = serve(socket_path, search_path, env)
    except BaseException:
        os.unlink(socket_path)
        raise
    import runpy

    runpy.run_path(request["argv"][0], run_name="__main__")
