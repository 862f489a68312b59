"""The body pipe between an engine replica and the gateway (src/unmask/cluster/pipe.py), and the gateway's side of a
piped response (ingress.Gateway._piped), over real loopback sockets without a cluster: the frames arrive in order
and end on the end frame (frames that arrived together as one piece), a token is good once, a connection that ends early is a broken pipe that the gateway
turns into the replica's error, and a client that leaves closes the pipe and cancels the call."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="Ray is optional: pip install 'unmask[ray]'")

import ray  # noqa: E402

from unmask.cluster import pipe  # noqa: E402
from unmask.cluster.ingress import Gateway  # noqa: E402


async def _served():
    server = pipe.PipeServer()
    await server.start("127.0.0.1")
    return server


async def _read_all(address, token) -> list[bytes]:
    reader, writer = await pipe.connect(address, token)
    try:
        return [piece async for piece in pipe.read_body(reader)]
    finally:
        writer.close()


def test_pieces_arrive_in_order_and_end_on_the_end_frame():
    async def main():
        server = await _served()
        p = server.open()
        for piece in (b"data: 1\n\n", b"x" * 70_000, b"data: [DONE]\n\n"):   # before the reader connects
            p.put(piece)
        p.end()
        got = await _read_all(server.address, p.token)
        await asyncio.wait_for(p.closed.wait(), 2)
        assert p.connected.is_set() and p.token not in server.pipes
        with pytest.raises(pipe.PipeBroken):   # a token is good once: the second reader gets no body
            await _read_all(server.address, p.token)
        await server.stop()
        return got

    got = asyncio.run(main())
    assert b"".join(got) == b"data: 1\n\n" + b"x" * 70_000 + b"data: [DONE]\n\n"


def test_pieces_written_apart_arrive_apart_and_together_as_one():
    async def main():
        server = await _served()
        p = server.open()
        reader, writer = await pipe.connect(server.address, p.token)
        await asyncio.wait_for(p.connected.wait(), 2)
        body = pipe.read_body(reader)
        got = []
        p.put(b"data: 1\n\n")
        got.append(await body.__anext__())
        p.put(b"data: 2\n\n")
        p.put(b"data: 3\n\n")   # in the same turn of the loop: one read on the other side
        p.put(b"")   # nothing: not the end frame
        got.append(await body.__anext__())
        p.put(b"y" * 200_000)   # more than one read
        await p.drain()
        got.append(await body.__anext__())
        p.end()
        got += [piece async for piece in body]
        await asyncio.wait_for(p.closed.wait(), 2)
        writer.close()
        await server.stop()
        return got

    assert asyncio.run(main()) == [b"data: 1\n\n", b"data: 2\n\ndata: 3\n\n", b"y" * 200_000]


def test_an_unknown_token_or_a_connection_cut_short_is_a_broken_pipe():
    async def main():
        server = await _served()
        reader, writer = await pipe.connect(server.address, "not-a-token")
        with pytest.raises(pipe.PipeBroken):
            async for _ in pipe.read_body(reader):
                pass
        writer.close()
        p = server.open()
        p.put(b"data: 1\n\n")
        reader, writer = await pipe.connect(server.address, p.token)
        got = []
        with pytest.raises(pipe.PipeBroken):
            async for piece in pipe.read_body(reader):
                got.append(piece)
                await server.stop()   # the replica goes away mid-body
        writer.close()
        return got

    assert asyncio.run(main()) == [b"data: 1\n\n"]


def test_a_reader_that_leaves_closes_the_pipe():
    async def main():
        server = await _served()
        p = server.open()
        p.put(b"data: 1\n\n")
        reader, writer = await pipe.connect(server.address, p.token)
        assert await reader.readexactly(4 + 9)
        writer.close()   # the gateway's client went away
        await asyncio.wait_for(p.closed.wait(), 2)
        p.put(b"data: 2\n\n")   # the producer has not noticed yet: nothing is written, nothing raises
        await p.drain()
        assert p._waiting == []
        await server.stop()

    asyncio.run(main())


class _Call:
    """The Ray call beside a piped body: its end, or the error a dead replica's call raises."""

    def __init__(self, error: BaseException | None = None):
        self.error, self.cancelled, self.read_to_end = error, False, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.error is not None:
            raise self.error
        self.read_to_end = True
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled = True


def _gateway():
    return Gateway(None, SimpleNamespace(database_url=None), "unmask")


def test_the_gateway_streams_a_piped_body_and_lets_the_call_end_by_itself():
    async def main(take=None, cut=False, error=None):
        server = await _served()
        p = server.open()
        reader, writer = await pipe.connect(server.address, p.token)
        call = _Call(error)
        gen = _gateway()._piped("/v1/chat/completions", b"head", call, reader, writer)
        out = []
        pieces = [b"data: 1\n\n", b"data: 2\n\n"] + ([] if cut else [b"data: [DONE]\n\n"])
        async for chunk in gen:   # the replica writes its next piece once the gateway has passed the last one on
            if pieces:
                p.put(pieces.pop(0))
                if not pieces and not cut:
                    p.end()
            out.append(chunk)
            if cut and len(out) == 3:   # the replica dies after its second frame
                await server.stop()
            if take is not None and len(out) == take:
                await gen.aclose()   # the client went away
                break
        await asyncio.sleep(0.05)   # the call's end is read off the client's clock
        await asyncio.wait_for(p.closed.wait(), 2)
        await server.stop()
        return out, call

    out, call = asyncio.run(main())
    assert out == [b"head", b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    assert call.read_to_end and not call.cancelled
    out, call = asyncio.run(main(take=2))
    assert out == [b"head", b"data: 1\n\n"] and call.cancelled
    dead = ray.exceptions.RayActorError()
    out, call = asyncio.run(main(cut=True, error=dead))
    assert out[:3] == [b"head", b"data: 1\n\n", b"data: 2\n\n"] and len(out) == 4
    error = json.loads(out[3].split(b"\n\n")[0].removeprefix(b"data: "))["error"]
    assert error["code"] == "replica_unavailable" and "died" in error["message"]
    assert out[3].endswith(b"data: [DONE]\n\n") and not call.cancelled   # the call had ended: nothing to cancel


class _Handle:
    """Ray Serve's deployment handle as the gateway calls it; each call answers with the next of `heads`."""

    def __init__(self, heads):
        self.heads, self.calls, self.streams = list(heads), [], []

    def options(self, **_):
        return self

    @property
    def forward(self):
        return self

    def remote(self, message, **kwargs):
        self.calls.append(kwargs)
        stream = _Items([self.heads.pop(0), {"end": b"data: [DONE]\n\n"}])
        self.streams.append(stream)
        return stream


class _Items(_Call):
    def __init__(self, items):
        super().__init__()
        self.items = list(items)

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)


def test_a_gateway_that_cannot_reach_a_pipe_runs_the_request_again_through_ray(caplog):
    from starlette.requests import Request

    with socket_closed() as port:
        head = {"status": 200, "headers": [(b"content-type", b"text/event-stream")], "body": b"data: 1\n\n",
                "more": True, "replica": "r1"}
        handle = _Handle([dict(head, pipe=("127.0.0.1", port, "t")), head])
        gateway = Gateway(handle, SimpleNamespace(database_url=None), "unmask")

        async def main():
            body = b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}'
            sent = iter([{"type": "http.request", "body": body, "more_body": False}])
            scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "root_path": "",
                     "query_string": b"", "headers": [], "client": None}
            response = await gateway.forward(Request(scope, lambda: _next(sent)))
            return [chunk async for chunk in response.body_iterator]

        chunks = asyncio.run(main())
    assert [c["direct"] for c in handle.calls] == [True, False]   # the second call asks for no pipe
    assert handle.streams[0].cancelled and not handle.streams[1].cancelled
    assert chunks == [b"data: 1\n\n", b"data: [DONE]\n\n"] and gateway.direct is False
    assert "cannot reach engine replica r1's body pipe" in caplog.text
    with pytest.MonkeyPatch.context() as mp:   # UNMASK_RAY_PIPE=0: no pipes from the start
        mp.setenv(pipe.ENV, "0")
        assert not pipe.wanted()
        mp.delenv(pipe.ENV)
        assert pipe.wanted()


async def _next(items):
    return next(items)


class socket_closed:
    """A loopback port with nothing listening on it."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc):
        return False
