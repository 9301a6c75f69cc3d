"""A llama.cpp RPC worker asked what it is, in Python, before llama.cpp's own client touches it.

ggml's RPC client aborts the whole process when a worker cannot be reached or does not answer (GGML_ABORT in
ggml-rpc.cpp), and waits for ever on one that is busy with another client. So every worker is first asked here,
over a socket with a timeout, in the protocol's own messages (HELLO, DEVICE_COUNT, GET_DEVICE_MEMORY): whether it
answers, its devices' free memory, and the link's round trip and bandwidth, which the plan prices layouts with.

Messages (ggml-rpc.cpp, protocol 7): a request is | command (1 byte) | size (8 bytes, little-endian) | data |, an
answer | size (8 bytes) | data |.
"""

from __future__ import annotations

import socket
import statistics
import struct
import time
from dataclasses import dataclass

from edgespec.errors import WorkerError

PROTOCOL_MAJOR, PROTOCOL_MINOR = 7, 0  # ggml-rpc.h of the llama.cpp that llama-cpp-python 0.3.36 vendors
HELLO, DEVICE_COUNT, GET_DEVICE_MEMORY = 14, 15, 11
CAPS_SIZE = 24  # transport capabilities in HELLO; zeros: plain TCP
DEFAULT_PORT = 50052  # llama.cpp's rpc-server's
PROBE_TIMEOUT = 5.0
RTT_SAMPLES = 20


@dataclass(frozen=True)
class Worker:
    """What a worker said of itself."""

    endpoint: str  # host:port
    version: tuple[int, int, int]
    devices: tuple[tuple[int, int], ...]  # (free, total) bytes per device it serves
    rtt_seconds: float  # median round trip of an empty request

    @property
    def free_bytes(self) -> int:
        return sum(free for free, _ in self.devices)


def parse_endpoints(text: str) -> tuple[str, ...]:
    """`--rpc HOST:PORT,...`: each endpoint checked (IPv4 or a name, a port), in order, without repeats."""
    out: list[str] = []
    for item in (s.strip() for s in text.split(",")):
        host, sep, port = item.rpartition(":")
        if not item or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise WorkerError(f"--rpc {item!r} is not HOST:PORT; give workers as 127.0.0.1:{DEFAULT_PORT},"
                              f"192.168.1.7:{DEFAULT_PORT} (what `edgespec worker` prints)")
        if item not in out:
            out.append(item)
    return tuple(out)


def probe(endpoint: str, timeout: float = PROBE_TIMEOUT) -> Worker:
    """Ask `endpoint` for its version, devices and memory, and time the round trip; a WorkerError names it when it
    cannot be reached, does not answer, or speaks another version of the protocol."""
    host, _, port = endpoint.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except OSError as e:
        raise WorkerError(f"RPC worker {endpoint} cannot be reached ({e.strerror or e}); start it there with "
                          f"`edgespec worker --host ADDRESS --port {port}`, or leave it out of --rpc") from e
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            major, minor, patch = _call(sock, HELLO, bytes(CAPS_SIZE), 4 + CAPS_SIZE)[:3]
            if major != PROTOCOL_MAJOR or minor > PROTOCOL_MINOR:
                raise WorkerError(f"RPC worker {endpoint} speaks protocol {major}.{minor}.{patch}, this edgespec "
                                  f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}: run `edgespec worker` from the same "
                                  f"edgespec and llama-cpp-python there")
            count = struct.unpack("<I", _call(sock, DEVICE_COUNT, b"", 4))[0]
            devices = tuple(struct.unpack("<QQ", _call(sock, GET_DEVICE_MEMORY, struct.pack("<I", d), 16))
                            for d in range(count))
            rtt = []
            for _ in range(RTT_SAMPLES):
                t0 = time.perf_counter()
                _call(sock, DEVICE_COUNT, b"", 4)
                rtt.append(time.perf_counter() - t0)
        except socket.timeout as e:
            raise WorkerError(f"RPC worker {endpoint} took the connection but did not answer within {timeout:g} s: "
                              f"it serves one client at a time, and another is using it; stop that client or "
                              f"start another worker") from e
        except (OSError, struct.error) as e:
            raise WorkerError(f"RPC worker {endpoint} closed the connection ({e}); is it an `edgespec worker` or "
                              f"llama.cpp rpc-server of protocol {PROTOCOL_MAJOR}?") from e
    return Worker(endpoint, (major, minor, patch), devices, statistics.median(rtt))


def probe_all(endpoints: tuple[str, ...], timeout: float = PROBE_TIMEOUT) -> list[Worker]:
    return [probe(e, timeout) for e in endpoints]


def _call(sock: socket.socket, command: int, payload: bytes, answer_size: int) -> bytes:
    sock.sendall(struct.pack("<BQ", command, len(payload)) + payload)
    size = struct.unpack("<Q", _recv(sock, 8))[0]
    if size != answer_size:
        raise OSError(f"answer of {size} bytes to command {command}, {answer_size} expected")
    return _recv(sock, size)


def _recv(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        piece = sock.recv(n - len(data))
        if not piece:
            raise OSError("connection closed")
        data += piece
    return bytes(data)
