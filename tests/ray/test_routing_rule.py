"""The fleet's routing rule (penstock.ray.routing), without Ray."""

from __future__ import annotations

from penstock.engines.context import Context
from penstock.ray.routing import affinity_key, choose, preference

REPLICAS = [f"replica-{i}" for i in range(5)]


def test_a_key_prefers_one_replica_and_only_a_leaving_one_moves_its_keys() -> None:
    keys = [f"session-{i}" for i in range(200)]
    first = {key: preference(key, REPLICAS)[0] for key in keys}
    assert len(set(first.values())) == len(REPLICAS)
    fewer = [r for r in REPLICAS if r != "replica-2"]
    moved = [key for key in keys if preference(key, fewer)[0] != first[key]]
    assert moved and all(first[key] == "replica-2" for key in moved)


def test_the_preferred_replica_is_kept_within_the_imbalance_bound() -> None:
    loads = [("a", 9), ("b", 1), ("c", 3)]
    assert choose("a", loads, max_imbalance=8) == "a"
    assert choose("a", loads, max_imbalance=7) == "b"
    assert choose(None, loads, max_imbalance=8) == "b"
    assert choose("a", [("a", None), ("b", 4)], max_imbalance=8) == "b"
    assert choose("a", [("a", None)], max_imbalance=8) is None


def test_the_session_key_wins_over_the_prompt_prefix() -> None:
    request = {"model": "m", "token_ids": list(range(100))}
    alice = Context("1", {"x-session-id": "alice"})
    assert affinity_key(request, alice, 64) == affinity_key({"model": "m"}, alice, 64)
    assert affinity_key(request, alice, 64) != affinity_key({"model": "lora"}, alice, 64)
    shared = {"model": "m", "token_ids": [*range(64), 7]}
    assert affinity_key(request, Context("2"), 64) == affinity_key(shared, Context("3"), 64)
    assert affinity_key(request, Context("2"), 0) is None
    assert affinity_key({"model": "m", "token_ids": [1, 2]}, Context("4"), 64) is None
