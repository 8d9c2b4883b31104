"""One tensor-parallel rank in its own process, driven by the caller over a socket.

Started by `WorkerPool` as `python -m nanoplug.plugins.parallel.tensor.rank FD RANK PARENT_PID` rather than
through multiprocessing, so the caller's `__main__` is never re-imported (a script without an
`if __name__ == "__main__"` guard still works). Messages are pickled tuples:

    caller -> worker  ("init", sys_path, factory_pickle, store_port, world_size, backend, timeout_s, cpu_threads)
                      ("call", method, args)        ("stop",)       (method: a nanoplug.api.WorkerMethod)
    worker -> caller  ("ok", result)  (rank 0's result; None on other ranks)
                      ("error", traceback_text)

Every message but "stop" and a LAUNCH or SAMPLE call gets one answer. A launch gets none, so the caller can
hand out step N+1 before it waits for step N (and a launched step's grammar bitmask follows it unanswered too): a launch that fails is reported in the answer to the
next call (the engine's `collect`), its traceback naming the launch. After an error the worker
stays up until told to stop, answering every call with that first error, so the caller sees the
first failure, not the communication errors it causes on other ranks. The worker exits when the
caller's socket closes or the caller's process is gone, so no worker outlives its engine.
"""
from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from nanoplug.api import WorkerMethod

STORE_HOST = "127.0.0.1"


UNANSWERED = (WorkerMethod.LAUNCH, WorkerMethod.SAMPLE)


def send(conn: Connection, message: Any) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _exit_with_parent(parent_pid: int) -> None:
    """Leave at once when the caller dies, even while blocked inside a collective."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=watch, name="nanoplug-parent-watch", daemon=True).start()


def _error(where: str) -> tuple[str, str]:
    return "error", f"[{where}, pid {os.getpid()} on {socket.gethostname()}]\n{traceback.format_exc()}"


def _build(message: tuple, rank: int) -> Any:
    """Join the process group and build this rank's model runner."""
    _, sys_path, factory_pickle, store_port, world_size, backend, timeout_s, cpu_threads = message
    sys.path[:0] = [p for p in sys_path if p not in sys.path]  # plugin classes the caller can import
    import torch
    import torch.distributed as dist

    from nanoplug.plugins.parallel.tensor.process_group import TorchGroup

    if cpu_threads:
        torch.set_num_threads(cpu_threads)
    timeout = timedelta(seconds=timeout_s)
    device_id = None
    if backend == "nccl" and world_size > 1:  # one GPU per rank; naming it makes NCCL connect now
        device_id = torch.device("cuda", rank)
        torch.cuda.set_device(device_id)
    store = dist.TCPStore(STORE_HOST, store_port, None, False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device_id)
    factory = pickle.loads(factory_pickle)
    return factory(TorchGroup(rank, world_size, local_rank=rank))


def serve(conn: Connection, rank: int) -> int:
    worker = failure = None  # failure: the first error here, the answer to every call after it
    while True:
        try:
            message = receive(conn)
        except (EOFError, OSError):
            return 0  # the caller is gone
        kind = message[0]
        if kind == "stop":
            break
        answered = not (kind == "call" and message[1] in UNANSWERED)  # see the module's docstring
        reply = failure
        if failure is None:
            try:
                if kind == "init":
                    worker = _build(message, rank)
                    reply = ("ok", None)
                else:
                    _, method, args = message
                    result = worker.call(method, *args)  # Worker.call refuses anything but a WorkerMethod
                    reply = ("ok", result if rank == 0 else None)
            except BaseException:
                what = getattr(message[1], "value", message[1]) if kind == "call" else ""
                failure = reply = _error(f"rank {rank}, {kind} {what}".strip())
        if not answered:
            continue
        try:
            payload = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # a result that cannot cross the process boundary is this rank's error too
            failure = _error(f"rank {rank}, sending the result of {kind}")
            payload = pickle.dumps(failure)
        try:
            conn.send_bytes(payload)
        except OSError:
            return 0  # the caller is gone
    if failure is not None:
        return 1  # the group may be mid-collective: tearing it down could block
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def main(argv: list[str]) -> int:
    fd, rank, parent_pid = (int(a) for a in argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller owns Ctrl-C and stops its workers itself
    faulthandler.enable()  # a hard crash still leaves a stack on stderr
    _exit_with_parent(parent_pid)
    return serve(Connection(fd), rank)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
