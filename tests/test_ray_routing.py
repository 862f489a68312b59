"""The affinity router's choices (src/unmask/cluster/routing.py) on given queue lengths, without a cluster: the
preferred replica of a prompt prefix first, the shortest queue when it is full or far busier, never a replica that
died on the request, and the stateful routes on their one replica."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="Ray is optional: pip install 'unmask[ray]'")

from unmask.cluster.routing import STATE_KEY, AffinityRouter, affinity_key, rendezvous  # noqa: E402


def replica(name: str):
    rid = SimpleNamespace(unique_id=name)
    return SimpleNamespace(replica_id=rid, actor_id=SimpleNamespace(hex=lambda: f"actor-{name}"))


def router(lens: dict[str, int], slots: int | None = 4):
    r = AffinityRouter.__new__(AffinityRouter)   # the choice alone: no controller, no replicas to probe
    r.initialize_state(slots=slots)
    r._replica_queue_len_cache = _ByName(lens)
    return r


class _ByName:
    def __init__(self, lens: dict[str, int]):
        self.lens = lens

    def get(self, replica_id):
        return self.lens.get(replica_id.unique_id)


def choose(r, replicas, **kwargs):
    pending = SimpleNamespace(kwargs=kwargs)
    ranks = asyncio.run(r.choose_replicas(replicas, pending))
    return [[x.replica_id.unique_id for x in rank] for rank in ranks]


REPLICAS = [replica(n) for n in ("a", "b", "c")]
KEY = affinity_key("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}')
PREFERRED = max("abc", key=lambda n: rendezvous(KEY, n))
OTHERS = sorted(set("abc") - {PREFERRED}, key=lambda n: rendezvous(KEY, n), reverse=True)


def test_the_preferred_replica_of_a_prefix_comes_first():
    assert KEY and KEY == affinity_key("/v1/chat/completions",
                                       b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}')
    assert choose(router({"a": 1, "b": 1, "c": 1}), REPLICAS, affinity=KEY) == [[PREFERRED], OTHERS]
    # busier than the others but with a free slot: still preferred (its prefix cache hits)
    assert choose(router({PREFERRED: 3, OTHERS[0]: 0, OTHERS[1]: 0}), REPLICAS, affinity=KEY) == [[PREFERRED], OTHERS]


def test_a_full_or_far_busier_preferred_replica_gives_way_to_the_shortest_queue():
    full = {PREFERRED: 4, OTHERS[0]: 1, OTHERS[1]: 2}   # its batch (4 slots) full, the others not
    assert choose(router(full), REPLICAS, affinity=KEY) == [list("abc")]
    everyone_full = {PREFERRED: 5, OTHERS[0]: 4, OTHERS[1]: 6}
    assert choose(router(everyone_full), REPLICAS, affinity=KEY) == [[PREFERRED], OTHERS]
    far = {PREFERRED: 12, OTHERS[0]: 3, OTHERS[1]: 3}    # 9 more than the least busy, past the 8 allowed
    assert choose(router(far, slots=None), REPLICAS, affinity=KEY) == [list("abc")]
    assert choose(router({PREFERRED: 11, OTHERS[0]: 3, OTHERS[1]: 3}, slots=None), REPLICAS,
                  affinity=KEY) == [[PREFERRED], OTHERS]


def test_a_retry_avoids_the_dead_replica_and_state_routes_stay_on_one():
    # the prefix's next replica first, among those left
    assert choose(router({}), REPLICAS, affinity=KEY, avoid=f"actor-{PREFERRED}") == [OTHERS[:1], OTHERS[1:]]
    assert choose(router({}), REPLICAS[:1], avoid="actor-a") == [[]]   # none left: Ray Serve waits for one
    assert choose(router({}), REPLICAS) == [list("abc")]                # no key: the shortest queue
    state = affinity_key("/v1/files", b"")
    assert state == STATE_KEY
    assert affinity_key("/v1/files", b"", shared_store=True) is None   # --database-url: any replica, shortest queue
    best = max("abc", key=lambda n: rendezvous(STATE_KEY, n))
    busy = {"a": 0, "b": 0, "c": 0, best: 9}          # full, and still the one: the state lives there
    assert choose(router(busy), REPLICAS, affinity=STATE_KEY) == [[best]]


class _Stream:
    """A replica's streamed answer as the gateway reads it: pieces, then the marked end; reading past the end or
    cancelling is recorded (the real stream's next item would cost one more Ray call)."""

    def __init__(self, pieces):
        self.pieces, self.read_past_end, self.cancelled = list(pieces), False, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.pieces:
            self.read_past_end = True
            raise StopAsyncIteration
        piece = self.pieces.pop(0)
        if isinstance(piece, BaseException):
            raise piece
        return piece

    def cancel(self):
        self.cancelled = True


def test_the_gateway_ends_a_response_on_the_replicas_marked_end():
    from unmask.cluster.ingress import Gateway

    async def read(stream, take=None):
        gateway = Gateway(None, SimpleNamespace(database_url=None), "unmask")
        out, gen = [], gateway._rest("/v1/chat/completions", b"head", stream)
        async for chunk in gen:
            out.append(chunk)
            if take is not None and len(out) == take:
                await gen.aclose()   # the client went away
                break
        return out

    done = _Stream([b"data: 1\n\n", {"end": b"data: [DONE]\n\n"}])
    assert asyncio.run(read(done)) == [b"head", b"data: 1\n\n", b"data: [DONE]\n\n"]
    assert not done.read_past_end and not done.cancelled
    left = _Stream([b"data: 1\n\n", {"end": b"data: [DONE]\n\n"}])   # a client that leaves after [DONE]
    asyncio.run(read(left, take=3))
    assert not left.cancelled
    cut = _Stream([b"data: 1\n\n", b"data: 2\n\n", {"end": b""}])      # one that leaves mid-stream
    asyncio.run(read(cut, take=2))
    assert cut.cancelled
    import json

    import ray

    lost = _Stream([b"data: 1\n\n", ray.exceptions.RayActorError()])    # the replica dies mid-body
    out = asyncio.run(read(lost))
    assert out[:2] == [b"head", b"data: 1\n\n"] and out[2].endswith(b"data: [DONE]\n\n") and not lost.cancelled
    assert json.loads(out[2].split(b"\n\n")[0].removeprefix(b"data: "))["error"]["code"] == "replica_unavailable"
