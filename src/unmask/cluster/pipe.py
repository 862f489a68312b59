"""A streamed body's direct path from an engine replica to the gateway: one TCP connection per response, beside the
Ray call that still carries the request, the head and the end of the work.

Why: through Ray Serve every streamed piece (one SSE frame per decoding step) is a Ray object of its own,
serialized and reported by the replica and fetched by the gateway, and on a machine whose cores the engine uses
all of, that CPU comes out of decoding (docs/scale-out.md, "The response's direct path"). Here a piece is four bytes
of length and the bytes, written to a socket.

The replica listens on its node's Ray address (the one the cluster's nodes already reach each other on) at a
port of the kernel's choosing, and answers a connection only with the body its one-use token names. The frames
are `length (4 bytes, big-endian) + bytes`; a zero length ends the body. A connection that ends without it means
the replica went away: the gateway asks the Ray call why.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

logger = logging.getLogger("unmask.cluster")

CONNECT_TIMEOUT_S = 10.0    # the gateway connects at once after the head; past this the replica gives the body up
END = b"\0\0\0\0"
READ_SIZE = 1 << 16        # bytes a read of the gateway takes at most
ENV = "UNMASK_RAY_PIPE"     # "0": every streamed piece as a Ray object, as before the pipes


def wanted() -> bool:
    return os.environ.get(ENV, "1") != "0"


@dataclass
class Pipe:
    token: str
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)     # the end frame was written
    closed: asyncio.Event = field(default_factory=asyncio.Event)    # the body was written, or the reader left
    _writer: asyncio.StreamWriter | None = None
    _waiting: list[bytes] = field(default_factory=list)   # frames put before the reader connected

    def put(self, piece: bytes) -> None:
        """Frame one piece of the body and write it to the socket now (before the reader connects: when it does).
        Written in the caller's turn of the event loop, not handed to another task: per piece, a queue and a
        wait for either it or the reader leaving cost the replica's event loop more than the write itself. An
        empty piece writes nothing (a zero length is the end frame)."""
        if piece:
            self._frame(len(piece).to_bytes(4, "big") + piece)

    def end(self) -> None:
        self._frame(END)
        self.ended.set()

    async def drain(self) -> None:
        """Wait while the socket's buffer is over its high-water mark (a reader slower than the engine)."""
        if self._writer is not None and not self.closed.is_set():
            with contextlib.suppress(ConnectionError, OSError):
                await self._writer.drain()

    def _frame(self, data: bytes) -> None:
        if self.closed.is_set():   # the reader left: nothing more to write
            return
        if self._writer is None:
            self._waiting.append(data)
        else:
            self._writer.write(data)

    def _attach(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        if self._waiting:
            writer.write(b"".join(self._waiting))
            self._waiting.clear()
        self.connected.set()


class PipeServer:
    """The replica's side: bodies waiting for their reader, by token."""

    def __init__(self):
        self.pipes: dict[str, Pipe] = {}
        self.address: tuple[str, int] | None = None
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, host: str) -> None:
        self._server = await asyncio.start_server(self._serve, host, 0)
        self.address = (host, self._server.sockets[0].getsockname()[1])

    def open(self) -> Pipe:
        pipe = Pipe(secrets.token_hex(16))
        self.pipes[pipe.token] = pipe
        return pipe

    def close(self, pipe: Pipe) -> None:
        self.pipes.pop(pipe.token, None)
        pipe.closed.set()

    async def stop(self) -> None:
        """No more connections, and the open ones end where they are (their readers see a broken pipe)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pipe = waits = None
        self._writers.add(writer)
        try:
            token = (await asyncio.wait_for(reader.readline(), CONNECT_TIMEOUT_S)).strip().decode("ascii", "replace")
            pipe = self.pipes.pop(token, None)
            if pipe is None:   # a stale or unknown token: nothing to read here
                return
            pipe._attach(writer)
            # the body is written by its producer (Pipe.put); this waits for its end, or for the reader to close
            # its side (it wants no more)
            waits = {asyncio.ensure_future(reader.read(1)), asyncio.ensure_future(pipe.ended.wait())}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if pipe.ended.is_set():
                await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, OSError) as e:
            logger.debug("body pipe: %s", e)
        finally:
            for w in waits or ():
                w.cancel()
            if pipe is not None:
                pipe.closed.set()
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()


class PipeBroken(Exception):
    """The connection ended before the body did: the replica went away."""


async def connect(address, token: str, timeout: float = CONNECT_TIMEOUT_S):
    host, port = address
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout)
    writer.write(token.encode("ascii") + b"\n")
    return reader, writer


async def read_body(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The body, in order, until its end; PipeBroken if the connection ends first. Frames that arrived together
    come as one piece (their bytes joined): one read and one write onward for them, not one each."""
    buf = bytearray()
    try:
        while True:
            data = await reader.read(READ_SIZE)
            if not data:
                raise PipeBroken("the connection closed before the end of the body")
            buf += data
            pieces, at, end = [], 0, False
            while len(buf) - at >= 4:
                size = int.from_bytes(buf[at:at + 4], "big")
                if size == 0:
                    end = True
                    break
                if len(buf) - at - 4 < size:
                    break
                pieces.append(bytes(buf[at + 4:at + 4 + size]))
                at += 4 + size
            del buf[:at]
            if pieces:
                yield b"".join(pieces)
            if end:
                return
    except ConnectionError as e:
        raise PipeBroken(str(e) or type(e).__name__) from None
