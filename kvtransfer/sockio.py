"""Blocking-socket I/O that both ends of the direct TCP data path use: bounded reads and writes, their threads.

Each side of a TCP transfer runs in one worker thread of `IO_POOL` on a blocking socket (one syscall
per piece, no event-loop hop per frame); `io_timeout` bounds every read and write, so a peer that
stalls is an error, never a hang.
"""
from __future__ import annotations

import concurrent.futures
import socket
import struct

from pdserve.kvtransfer.frames import TransferError

# Blocking socket work: one thread per live transfer side (and per kept connection a receiver serves).
IO_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="pdkv-io")


def io_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound every send and receive on a blocking socket by `seconds` without progress (SO_SNDTIMEO /
    SO_RCVTIMEO), so a stalled peer is an error. Not `settimeout`: that makes the socket non-blocking
    under the hood, MSG_WAITALL then returns whatever has arrived, and each read becomes poll + recv
    for every ~64 KiB. Here a read of a 256 KiB piece sleeps in the kernel until the piece is there."""
    sock.settimeout(None)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


# a blocking socket with SO_RCVTIMEO/SO_SNDTIMEO reports a timeout as EAGAIN (BlockingIOError)
STALLED = (socket.timeout, BlockingIOError)


def recv_exact(sock: socket.socket, buf, then=None) -> memoryview:
    """Fill `buf` (then `then`, if given, in the same reads) from the socket: blocking, with the socket's
    timeout per read. TransferError on EOF. → `buf`."""
    mv = memoryview(buf).cast("B")
    if then is not None:
        bufs = [mv, memoryview(then).cast("B")]
        want = left = len(bufs[0]) + len(bufs[1])
        while True:
            n = sock.recvmsg_into(bufs, 0, socket.MSG_WAITALL)[0]  # all of it, unless a signal or a timeout
            left -= n
            if not left:
                return mv
            if n == 0:
                raise TransferError(f"stream truncated: got {want - left} of {want} bytes")
            while n >= len(bufs[0]):
                n -= len(bufs.pop(0))
            bufs[0] = bufs[0][n:]
    got, want = 0, len(mv)
    while got < want:
        n = sock.recv_into(mv[got:], want - got, socket.MSG_WAITALL)
        if n == 0:
            raise TransferError(f"stream truncated: got {got} of {want} bytes")
        got += n
    return mv
