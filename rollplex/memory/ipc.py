"""Handing VMM page handles (POSIX file descriptors) to another process over a Unix socket.

What it is: the transport that lets the rollout process map the trainer's BF16 snapshot zero-copy. The
exporting side opens a `HandleServer` (a socket in a fresh private 0700 directory) and `send`s named file
descriptors; the importing side calls `receive_handles(path)`. `share_regions` / `attach_regions` do the
same for `VmmArena` regions. The transport itself is plain POSIX (SCM_RIGHTS through
`multiprocessing.reduction`): it needs no GPU and is tested on CPU with memfds. What it is not: a channel
for data; only descriptors and their names and sizes travel.

Nothing is left behind: the socket file and its directory are removed as soon as the peer has connected
(and at `close()`, exit, garbage collection), every descriptor this side opened is closed once sent, and
the receiver owns what it receives. A process killed with SIGKILL before a peer connects leaves an empty
socket in its private directory; nothing else outlives a process (the kernel and driver reclaim
descriptors, handles and mappings).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import tempfile
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing.reduction import recvfds, sendfds
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollplex.memory.vmm import Region, VmmArena

MAX_FDS_PER_MESSAGE = 200  # below the kernel's SCM_RIGHTS limit of 253
_HEADER = struct.Struct("!Q")


@dataclass(frozen=True, slots=True)
class HandleSpec:
    name: str
    num_bytes: int


def _recv_exact(conn: socket.socket, num_bytes: int) -> bytes:
    data = b""
    while len(data) < num_bytes:
        part = conn.recv(num_bytes - len(data))
        if not part:
            raise ConnectionError(f"peer closed the handle socket after {len(data)} of {num_bytes} bytes")
        data += part
    return data


def _cleanup(listener: socket.socket, conns: list[socket.socket], directory: str) -> None:
    for conn in conns:
        conn.close()
    listener.close()
    shutil.rmtree(directory, ignore_errors=True)


class HandleServer:
    """The exporting side: a listening Unix socket in a private directory, serving one peer.

    OPEN (directory 0700 + socket listening at `path`) --send()--> SENT (socket file and directory
    already removed) --close() / exit / garbage collection--> CLOSED
    """

    def __init__(self, timeout_s: float = 120.0) -> None:
        self.directory = tempfile.mkdtemp(prefix="rollplex-ipc-")  # mode 0700
        self.path = os.path.join(self.directory, "handles.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conns: list[socket.socket] = []
        self._finalizer = weakref.finalize(self, _cleanup, self._listener, self._conns, self.directory)
        self._listener.settimeout(timeout_s)
        self._listener.bind(self.path)
        self._listener.listen(1)

    def __enter__(self) -> HandleServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._finalizer()

    def send(self, specs: Sequence[HandleSpec], fds: Sequence[int]) -> None:
        """Wait for one peer, send it the specs and the descriptors (the caller still owns and closes
        `fds`), and return once the peer acknowledges receipt."""
        if len(specs) != len(fds):
            raise ValueError(f"{len(specs)} specs for {len(fds)} file descriptors")
        try:
            conn, _ = self._listener.accept()
        except TimeoutError as error:
            raise TimeoutError(f"no process connected to {self.path} within the timeout") from error
        self._conns.append(conn)
        conn.settimeout(self._listener.gettimeout())
        shutil.rmtree(self.directory, ignore_errors=True)  # connected: nobody else may find the socket
        header = json.dumps([asdict(spec) for spec in specs]).encode()
        conn.sendall(_HEADER.pack(len(header)) + header)
        for start in range(0, len(fds), MAX_FDS_PER_MESSAGE):
            sendfds(conn, list(fds[start : start + MAX_FDS_PER_MESSAGE]))
        if _recv_exact(conn, 1) != b"A":
            raise ConnectionError("the peer did not acknowledge the handles")


def receive_handles(path: str, timeout_s: float = 120.0) -> list[tuple[HandleSpec, int]]:
    """Connect to a `HandleServer` at `path` and receive its named descriptors, which the caller owns."""
    received: list[int] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        conn.connect(path)
        try:
            (size,) = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
            specs = [HandleSpec(**entry) for entry in json.loads(_recv_exact(conn, size))]
            for start in range(0, len(specs), MAX_FDS_PER_MESSAGE):
                received += recvfds(conn, len(specs[start : start + MAX_FDS_PER_MESSAGE]))
            conn.sendall(b"A")
        except BaseException:
            for fd in received:
                os.close(fd)
            raise
    return list(zip(specs, received, strict=True))


def share_regions(server: HandleServer, arena: VmmArena, regions: Sequence[Region]) -> None:
    """Export `regions` of a `VmmArena` and send them through `server` (blocks until a peer takes them)."""
    fds: list[int] = []
    try:
        for region in regions:
            fds.append(arena.export(region))
        server.send([HandleSpec(r.name, r.num_bytes) for r in regions], fds)
    finally:
        for fd in fds:
            os.close(fd)


def attach_regions(arena: VmmArena, path: str, timeout_s: float = 120.0) -> dict[str, Region]:
    """Receive the regions a peer shares at `path` and map them into `arena`: name -> Region."""
    pending = receive_handles(path, timeout_s)
    regions = {}
    try:
        while pending:
            spec, fd = pending.pop(0)
            regions[spec.name] = arena.attach(spec.name, spec.num_bytes, fd)  # attach consumes fd
    finally:
        for _, fd in pending:
            os.close(fd)
    return regions
