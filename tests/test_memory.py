"""Cross-request memory on literal token lists: longest match, eviction, the file (round trip, tokenizer change,
damage, permissions), namespaces, and auto's use of it under the policy."""

from __future__ import annotations

import logging
import stat
import time

import numpy as np
import pytest

from edgespec import memory as mem
from edgespec.decoding.costs import CostTracker
from edgespec.memory import Memory, MemoryBank
from edgespec.decoding.policy import Bets, Costs, choose_proposal, match_prior, memory_class, memory_prior
from edgespec.proposers.auto import AutoProposer
from edgespec.proposers.memory import MemoryProposer
from edgespec.proposers.ngram import NgramProposer

A = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
B = [20, 3, 4, 5, 6, 30, 31, 32, 33]


def test_the_longest_match_wins_and_its_continuation_is_proposed():
    m = Memory(None)
    m.add(A)
    m.add(B)
    assert m.lookup([99, 2, 3, 4, 5, 6], 3) == mem.Match([7, 8, 9], 5, 1)  # A matches 5 back, B only 4
    assert m.lookup([99, 20, 3, 4, 5, 6], 3) == mem.Match([30, 31, 32], 5, 1)
    # Both match 4 tokens back and continue differently: the latest place wins.
    assert m.lookup([99, 3, 4, 5, 6], 8) == mem.Match([30, 31, 32, 33], 4, 1)  # cut at the entry's end
    assert m.lookup([99, 7, 8, 9, 10], 4) is None  # the last token of an entry has no continuation
    assert m.lookup([3, 4, 5], 4) is None  # shorter than the shortest key
    assert m.lookup([99, 98, 97, 96], 4) is None
    assert m.lookup([1, 2, 3, 4], 0) is None


def test_seen_counts_the_places_that_agree_and_a_long_key_finds_old_long_matches():
    m = Memory(None)
    for tail in ([40, 41], [40, 42], [50, 51]):
        m.add([8, 3, 4, 5, 6, *tail, 0, 0])
    found = m.lookup([8, 3, 4, 5, 6], 2)
    assert found.seen == 2 and found.tokens == [40, 42] and found.length == 5
    long = list(range(100, 140))
    m.add(long)
    for i in range(mem.CANDIDATES + 5):  # the 4-token key of `long`'s end occurs later in many entries
        m.add([200 + i, 130, 131, 132, 133, 300 + i, 0, 0])
    found = m.lookup(long[:34], 3)
    assert found.tokens == [134, 135, 136] and found.length == 34


def test_least_recently_used_entries_go_first():
    m = Memory(None, max_tokens=40)
    entries = [[k * 100 + i for i in range(10)] for k in range(1, 6)]
    for e in entries[:4]:
        m.add(e)
    assert m.lookup(entries[0][:5], 2).tokens == entries[0][5:7]  # entry 0 used: now the most recent
    m.add(entries[4])  # 50 tokens > 40: down to 36, i.e. the three most recently used
    assert m.n_tokens == 30 and m.entries() == [entries[0], entries[3], entries[4]]
    assert m.lookup(entries[1][:5], 2) is None and m.lookup(entries[2][:5], 2) is None
    assert m.lookup(entries[3][:5], 2).tokens == entries[3][5:7]


def test_an_entry_written_again_is_kept_once_and_short_ones_not_at_all():
    m = Memory(None)
    assert m.add(A) and not m.add(A) and not m.add([1, 2, 3])
    assert m.n_entries == 1
    with pytest.raises(ValueError, match="token ids"):
        m.add([1, 2, 3, 4, 5, 6, 7, -8])


def test_persistence_round_trip_in_private_files(tmp_path):
    path = tmp_path / "memory" / "model" / "local.mem"
    m = Memory(path, "fp-1")
    m.add(A)
    m.add(B)
    m.save()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.parent.stat().st_mode) == 0o700
    again = Memory(path, "fp-1")
    assert again.entries() == [A, B]
    assert again.lookup([99, 2, 3, 4, 5, 6], 3).tokens == [7, 8, 9]
    assert [f.entries for f in mem.files(tmp_path / "memory")] == [2]
    assert list(tmp_path.rglob("*.tmp")) == []  # the atomic write left no temporary file


def test_a_tokenizer_change_invalidates_the_file(tmp_path, caplog):
    path = tmp_path / "m" / "local.mem"
    m = Memory(path, "tokenizer-a")
    m.add(A)
    m.save()
    with caplog.at_level(logging.WARNING, logger="edgespec.memory"):
        other = Memory(path, "tokenizer-b")
        assert other.n_entries == 0 and other.lookup([1, 2, 3, 4], 3) is None
    assert "another tokenizer" in caplog.text
    other.add(B)
    other.save()
    assert Memory(path, "tokenizer-b").entries() == [B]
    assert Memory(path, "tokenizer-a").n_entries == 0


@pytest.mark.parametrize("damage", [b"garbage", "truncate", "header"])
def test_a_damaged_file_is_set_aside_with_a_warning(tmp_path, caplog, damage):
    path = tmp_path / "m" / "local.mem"
    m = Memory(path, "fp")
    m.add(A)
    m.save()
    data = path.read_bytes()
    bad = data[:-6] if damage == "truncate" else data.replace(b'"lengths"', b'"lengthz"') if damage == "header" \
        else damage
    path.write_bytes(bad)
    with caplog.at_level(logging.WARNING, logger="edgespec.memory"):
        m = Memory(path, "fp")
        assert m.lookup([1, 2, 3, 4], 3) is None
    assert "damaged" in caplog.text and len(caplog.records) == 1
    aside = list(path.parent.glob("local.mem.damaged-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == bad and not path.exists()
    m.add(B)  # the memory goes on, and saves a good file again
    m.save()
    assert Memory(path, "fp").entries() == [B]


def test_a_bank_keeps_namespaces_apart(tmp_path):
    bank = MemoryBank(tmp_path / "model", lambda: "fp")
    bank.get("alice").add(A)
    assert bank.get("bob").lookup([99, 2, 3, 4, 5, 6], 3) is None
    assert bank.get("alice").lookup([99, 2, 3, 4, 5, 6], 3).tokens == [7, 8, 9]
    bank.close()
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["alice.mem"]  # bob wrote nothing
    with pytest.raises(ValueError, match="namespace"):
        bank.get("../escape")
    assert [p.name for p in mem.clear(tmp_path)] == ["alice.mem"] and mem.files(tmp_path) == []


def test_a_key_namespace_does_not_hold_the_key():
    ns = mem.namespace_of_key("secret-key")
    assert "secret" not in ns and len(ns) == 16 and ns != mem.namespace_of_key("other-key")


def test_the_proposer_stops_at_the_end_of_a_turn():
    m = Memory(None)
    m.add([1, 2, 3, 4, 5, 6, 99, 7, 8])
    p = MemoryProposer(lambda t: t == 99, m)
    got = p.propose([0, 2, 3, 4, 5], 4)
    assert got.tokens == [6] and got.source == "memory" and got.match == 4 and got.seen == 1
    assert MemoryProposer(lambda t: False).propose([0, 2, 3, 4, 5], 4).tokens == []  # no memory: nothing


def test_memory_is_priced_like_lookup_and_gated_by_its_pessimistic_estimates():
    cpu64 = Costs((1, 2, 4, 8, 16, 32, 64), (1.0, 1.5, 1.9, 3.3, 4.5, 8.0, 13.0))
    assert memory_prior(memory_class(40, 1)) == match_prior(8) and memory_class(40, 5) == memory_class(40, 3)
    assert choose_proposal(cpu64, Bets(memory=[0.99] * 63, memory_low=[0.97] * 63), 63) == ("memory", 63)
    assert choose_proposal(cpu64, Bets(memory=[0.99] * 63, memory_low=[0.2] * 63), 63) == ("none", 0)
    both = Bets(ngram=[0.9] * 8, ngram_low=[0.85] * 8, memory=[0.99] * 63, memory_low=[0.97] * 63)
    assert choose_proposal(cpu64, both, 63)[0] == "memory"
    better_lookup = Bets(ngram=[0.99] * 63, ngram_low=[0.97] * 63, memory=[0.9] * 63, memory_low=[0.85] * 63)
    assert choose_proposal(cpu64, better_lookup, 63)[0] == "ngram"


def auto_with(memory: Memory) -> AutoProposer:
    costs = Costs((1, 2, 4, 8, 16, 32, 64), (1.0, 1.5, 1.9, 3.3, 4.5, 8.0, 13.0))
    auto = AutoProposer(NgramProposer(lambda t: False), None, CostTracker(costs))
    auto.memory = MemoryProposer(lambda t: False, memory)
    auto.begin([0], None, np.random.default_rng(0))
    return auto


def test_auto_bets_on_a_long_memory_match_and_learns_from_its_failures():
    rng = np.random.default_rng(1)
    answer = rng.integers(1000, 2000, 200).tolist()
    m = Memory(None)
    m.add(answer)
    auto = auto_with(m)
    got = auto.propose([5, 6, *answer[:64]], 63)
    assert got.source == "memory" and len(got.tokens) >= 15 and got.tokens == answer[64:64 + len(got.tokens)]
    # The same memory, but the text now goes elsewhere after every 8-token match: the estimates fall and auto
    # stops betting on matches of that length.
    m2 = Memory(None)
    for i in range(30):
        m2.add([*rng.integers(3000, 4000, 8).tolist(), *rng.integers(1000, 2000, 20).tolist()])
    auto = auto_with(m2)
    sources, context = [], [1, 2]
    for entry in m2.entries()[:25]:
        context += entry[:8]
        sources.append(auto.propose(context, 63).source)
        context += [7, 7, 7]  # what the target "committed": never the memory's continuation
    assert sources[0] == "memory" and sources[-5:] == ["none"] * 5, sources


def test_a_new_request_keeps_half_of_the_memory_estimates_evidence_and_all_of_lookups():
    auto = auto_with(Memory(None))
    key = memory_class(7, 2)
    for _ in range(10):
        auto.memory_accept.update(key, True)
        auto.ngram_accept.update(5, True)
    memory_before, lookup_before = auto.memory_accept._counts[key], auto.ngram_accept._counts[5]
    auto.begin([1, 2, 3], None, None)
    assert auto.memory_accept._counts[key] == pytest.approx(tuple(c * 0.5 for c in memory_before))
    assert auto.ngram_accept._counts[5] == lookup_before  # lookup's carry stays 1.0 (docs/bench/replay-curves.md)


def test_lookup_cost_stays_small_on_a_full_store():
    m = Memory(None, max_tokens=mem.DEFAULT_MAX_TOKENS)
    rng = np.random.default_rng(2)
    for _ in range(mem.DEFAULT_MAX_TOKENS // 4096):
        m.add(rng.integers(0, 300, 4096).tolist())  # a small vocabulary: many candidates per key
    context = m.entries()[-3][:200]
    t = time.perf_counter()
    for _ in range(200):
        assert m.lookup(context, 63) is not None
    per_lookup = (time.perf_counter() - t) / 200
    assert per_lookup < 2e-3, f"{per_lookup * 1e6:.0f} us per lookup"  # a target step costs 30 ms here
