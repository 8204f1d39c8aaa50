"""Messages between the host and the sandbox launcher: a length-prefixed JSON header, then raw byte blobs
whose lengths the header lists. Stdlib only, and light: the launcher forks faster with fewer modules loaded."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Sequence

LENGTH = struct.Struct("<I")


def encode(header: dict, blobs: Sequence[bytes] = ()) -> bytes:
    raw = json.dumps(dict(header, blobs=[len(b) for b in blobs])).encode()
    return LENGTH.pack(len(raw)) + raw + b"".join(blobs)


def split(header: dict, data: bytes) -> list[bytes]:
    blobs, pos = [], 0
    for size in header["blobs"]:
        blobs.append(data[pos:pos + size])
        pos += size
    return blobs


def decode(buf: bytes) -> tuple[dict, list[bytes]]:
    (n,) = LENGTH.unpack_from(buf)
    header = json.loads(buf[4:4 + n])
    return header, split(header, buf[4 + n:])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("sandbox launcher closed the connection")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def recv(sock: socket.socket) -> tuple[dict, list[bytes]]:
    (n,) = LENGTH.unpack(_recv_exact(sock, 4))
    header = json.loads(_recv_exact(sock, n))
    return header, split(header, _recv_exact(sock, sum(header["blobs"])))

