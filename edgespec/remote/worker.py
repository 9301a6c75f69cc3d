"""`edgespec worker`: llama.cpp's RPC server, from the library edgespec already installed, serving one device of
this machine to a target on another.

The protocol has no authentication and no encryption: anyone who reaches the port can run computations there and
read what is sent. So it binds 127.0.0.1 unless told otherwise, and says so, in llama.cpp's own words, when told.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from edgespec import devices
from edgespec.errors import WorkerError
from edgespec.remote import probe

DEFAULT_HOST = "127.0.0.1"
# llama.cpp's tools/rpc/rpc-server.cpp prints this for any host other than 127.0.0.1.
WARNING = """
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
WARNING: Host ('{host}') is != '127.0.0.1'
         Never expose the RPC server to an open network!
         This is an experimental feature and is not secure!
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
"""
READY_TIMEOUT = 30.0


def check_host(host: str) -> str:
    """The address to bind: an IPv4 address (llama.cpp's server takes no names and no IPv6)."""
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        raise WorkerError(f"--host {host!r} is not an IPv4 address; llama.cpp's RPC server binds one, e.g. "
                          f"--host 127.0.0.1 (this machine only) or --host 192.168.1.7 (the LAN interface)") from None


def check_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise WorkerError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port, or stop "
                              f"what uses it") from e


def run(host: str, port: int, threads: int, device: str | None, cache_dir: Path | None,
        say: Callable[[str], None] = lambda text: print(text, file=sys.stderr)) -> None:
    """Serve until SIGINT or SIGTERM; a worker that cannot listen or dies is a WorkerError."""
    devices.require_rpc()
    host = check_host(host)
    check_port_free(host, port)
    if host != DEFAULT_HOST:
        say(WARNING.format(host=host))
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)  # llama.cpp does not create it
    handle = devices.device_handle(device)
    endpoint = f"{host}:{port}"
    failed = threading.Event()

    def serve() -> None:  # returns only when the server failed
        try:
            devices.serve_rpc(endpoint, handle, threads, str(cache_dir) if cache_dir else None)
        finally:
            failed.set()

    threading.Thread(target=serve, name="rpc-server", daemon=True).start()
    worker = _wait_ready(endpoint, failed)
    free = worker.free_bytes / 2**20
    say(f"edgespec worker: {device or 'default device'} ({free:.0f} MiB free) on {endpoint}, {threads} threads"
        + (f", weights cached in {cache_dir}" if cache_dir else "") + "; Ctrl-C stops it")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: os._exit(0))  # the C server thread never returns; nothing to clean up
    while not failed.wait(1.0):
        pass
    raise WorkerError(f"the RPC server on {endpoint} stopped; see the messages above")


def _wait_ready(endpoint: str, failed: threading.Event) -> probe.Worker:
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        if failed.is_set():
            raise WorkerError(f"llama.cpp's RPC server could not start on {endpoint}; see the messages above")
        try:
            return probe.probe(endpoint, timeout=2.0)
        except WorkerError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
