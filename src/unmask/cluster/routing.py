"""Which engine replica answers a request: the shortest queue, except that requests sharing a prompt prefix (the
turns of one chat session, completions of one long prompt) prefer the same replica, so its prefix cache keeps
hitting.

`affinity_key` runs in the ingress on the raw body; `AffinityRouter` is the Ray Serve request router of the engine
deployment (it runs inside whoever holds the handle: the ingress). The preferred replica of a key is chosen by
rendezvous hashing (highest hash of key and replica id), so when a replica comes or goes only its own keys move.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

PREFIX_CHARS = 512            # a completions prompt's affinity: its first characters
STATE_KEY = "state"           # the stateful APIs (files, batches, vector stores): one replica (unless shared)
STATE_PREFIXES = ("/v1/files", "/v1/batches", "/v1/vector_stores")


def _chat_prefix(messages: Any) -> Any:
    """The messages up to and including the first user message: the same on every turn of one conversation."""
    if not isinstance(messages, list):
        return None
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            return messages[:i + 1]
    return messages[:1]


def affinity_key(path: str, body: bytes, shared_store: bool = False) -> str | None:
    """A short hash naming the prompt prefix of a request, or None (no preference: shortest queue). The stateful
    routes go to one replica (STATE_KEY: the store of its node's --data-dir), or to any with a `shared_store`
    (--database-url: every replica on every node sees the same database)."""
    if path.startswith(STATE_PREFIXES):
        return None if shared_store else STATE_KEY
    if not body or not path.startswith("/v1/"):
        return None
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict):
        return None
    explicit = obj.get("prompt_cache_key")   # OpenAI's name for exactly this hint
    if isinstance(explicit, str) and explicit:
        prefix: Any = explicit
    elif path == "/v1/chat/completions":
        prefix = _chat_prefix(obj.get("messages"))
    elif path == "/v1/responses":
        items = obj.get("input")
        prefix = [obj.get("instructions"), items[:1] if isinstance(items, list) else items]
    elif "prompt" in obj:
        prompt = obj["prompt"]
        prefix = prompt[:PREFIX_CHARS] if isinstance(prompt, (str, list)) else None
    else:
        return None
    if prefix is None:
        return None
    text = json.dumps(prefix, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def rendezvous(key: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{replica_id}".encode(), digest_size=8).digest(), "big")


class AffinityRouter(RequestRouter):
    """Ranks [preferred replica of the request's key] before [the others]; Ray Serve picks the shortest queue
    within a rank and moves to the next rank when every replica of it is full. A request without a key, or whose
    preferred replica has `imbalance` more requests in flight than the least busy one, or a full batch (`slots`:
    --max-num-seqs) while another has a free slot, gets one rank of every replica: the shortest queue (waiting for
    a slot costs more than the prefix cache saves). A retried request (`avoid`: the actor id of the replica that died on it) goes to
    any other replica; with none, Ray Serve waits for one to start (the gateway bounds that wait)."""

    def initialize_state(self, imbalance: int = 8, slots: int | None = None, **kwargs) -> None:
        self.imbalance, self.slots = imbalance, slots

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        key, avoid = kwargs.get("affinity"), kwargs.get("avoid")
        if avoid:   # a retry: never the replica that died on it
            candidate_replicas = [r for r in candidate_replicas if r.actor_id.hex() != avoid]
        if not key or len(candidate_replicas) < 2:
            return [candidate_replicas]
        ranked = sorted(candidate_replicas, key=lambda r: rendezvous(key, r.replica_id.unique_id), reverse=True)
        # the files and batches live in the --data-dir of that replica's node (shared by the replicas of one node,
        # not across nodes; without --database-url): wait for it rather than go elsewhere
        if key == STATE_KEY:
            return [ranked[:1]]
        cache = self.replica_queue_len_cache
        lens = [cache.get(r.replica_id) for r in ranked]
        known = [n for n in lens if n is not None]
        if lens[0] is not None and (lens[0] - min(known) > getattr(self, "imbalance", 8)
                                    or self._full(lens[0]) and not self._full(min(known))):
            return [candidate_replicas]
        return [ranked[:1], ranked[1:]]

    def _full(self, in_flight: int) -> bool:
        slots = getattr(self, "slots", None)
        return slots is not None and in_flight >= slots
