"""Prompt lookup on literal token arrays."""

from edgespec.proposers.ngram import NgramProposer

EOS = 99


def proposer(n_min=2, n_max=4):
    p = NgramProposer(lambda t: t == EOS, n_min, n_max)
    return p


def test_proposes_what_followed_the_longest_recent_match():
    p = proposer()
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    p.begin(ctx)
    assert p.propose(ctx, 3).tokens == [4, 5, 6]


def test_prefers_the_longest_suffix_match():
    p = proposer()
    # "2 3" followed by 9 most recently, but "1 2 3" (longer) was followed by 4
    ctx = [1, 2, 3, 4, 0, 2, 3, 9, 5, 1, 2, 3]
    p.begin(ctx)
    prop = p.propose(ctx, 2)
    assert prop.tokens == [4, 0]
    assert prop.match == 3


def test_match_length_reaches_past_n_max():
    p = proposer()
    span = [10, 11, 12, 13, 14, 15, 16]
    ctx = [1, *span, 20, 21, 5, *span]  # the last 7 tokens repeat, preceded by different ones
    p.begin(ctx)
    prop = p.propose(ctx, 2)
    assert prop.tokens == [20, 21] and prop.match == 7


def test_most_recent_occurrence_wins_among_equal_lengths():
    p = proposer(n_min=2, n_max=2)
    ctx = [7, 8, 1, 0, 7, 8, 2, 0, 7, 8]
    p.begin(ctx)
    assert p.propose(ctx, 1).tokens == [2]


def test_the_occurrence_with_the_longest_match_wins_over_a_more_recent_one():
    p = proposer(n_min=2, n_max=2)
    # "7 8" last occurred after 3 (followed by 2), but the span "5 6 7 8" being copied was followed by 1
    ctx = [5, 6, 7, 8, 1, 0, 3, 7, 8, 2, 0, 9, 5, 6, 7, 8]
    p.begin(ctx)
    prop = p.propose(ctx, 2)
    assert prop.tokens == [1, 0] and prop.match == 4


def test_never_proposes_past_eos():
    p = proposer()
    ctx = [1, 2, 3, 4, EOS, 5, 1, 2, 3]
    p.begin(ctx)
    assert p.propose(ctx, 5).tokens == [4]


def test_no_match_gives_an_empty_proposal():
    p = proposer()
    ctx = [1, 2, 3, 4, 5]
    p.begin(ctx)
    assert p.propose(ctx, 4).tokens == []
    assert p.propose(ctx, 0).tokens == []


def test_index_follows_committed_tokens():
    p = proposer()
    ctx = [5, 6, 7, 8]
    p.begin(ctx)
    assert p.propose(ctx, 2).tokens == []
    ctx += [9, 5, 6]
    assert p.propose(ctx, 2).tokens == [7, 8]


class CountingDict(dict):
    ops = 0

    def get(self, key, default=None):
        CountingDict.ops += 1
        return super().get(key, default)

    def __setitem__(self, key, value):
        CountingDict.ops += 1
        super().__setitem__(key, value)


def test_work_per_cycle_does_not_grow_with_the_context():
    p = proposer(n_min=2, n_max=4)
    p._index = CountingDict()
    ctx = [(i * 7919) % 5000 for i in range(100_000)]
    p.begin(ctx)
    for n_new in (1, 5):
        ctx += [i % 50 for i in range(n_new)]
        CountingDict.ops = 0
        p.propose(ctx, 8)
        # per new token and n (3): a get, and an insert for an n-gram not seen before; per lookup: a get per n
        assert CountingDict.ops <= 2 * 3 * n_new + 3
