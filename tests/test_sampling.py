"""Sampling on literal logits: the filters, greedy ties, reproducibility, and the sampled distribution."""

import numpy as np
import pytest

from edgespec.decoding import sampling
from edgespec.config import SamplingConfig
from edgespec.errors import InvalidRequestError


def test_greedy_takes_first_of_ties():
    assert sampling.greedy(np.array([0.0, 3.0, 3.0, 1.0], dtype=np.float32)) == 1


def test_top_k_keeps_the_k_largest_in_order():
    logits = np.array([1.0, 5.0, 3.0, 4.0, 2.0], dtype=np.float32)
    ids, p = sampling.distribution(logits, SamplingConfig(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0))
    assert ids.tolist() == [1, 3, 2]
    assert p.sum() == pytest.approx(1.0)
    assert np.all(np.diff(p) < 0)


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    ids, p = sampling.distribution(logits, SamplingConfig(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0))
    assert ids.tolist() == [0, 1]
    np.testing.assert_allclose(p, [0.5 / 0.8, 0.3 / 0.8], rtol=1e-6)


def test_min_p_drops_tokens_below_fraction_of_best():
    probs = np.array([0.6, 0.3, 0.07, 0.03])
    logits = np.log(probs).astype(np.float32)
    ids, _ = sampling.distribution(logits, SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1))
    assert ids.tolist() == [0, 1, 2]  # 0.03 < 0.1 * 0.6


def test_temperature_sharpens_after_filtering():
    logits = np.array([2.0, 1.0, 0.0], dtype=np.float32)
    _, hot = sampling.distribution(logits, SamplingConfig(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0))
    _, cold = sampling.distribution(logits, SamplingConfig(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0))
    assert cold[0] > hot[0]
    np.testing.assert_allclose(cold, np.exp([4, 2, 0]) / np.exp([4, 2, 0]).sum(), rtol=1e-6)


def test_seeded_sampling_is_reproducible():
    rng_logits = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    cfg = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    a = [sampling.sample(rng_logits, cfg, np.random.default_rng(7)) for _ in range(3)]
    b = [sampling.sample(rng_logits, cfg, np.random.default_rng(7)) for _ in range(3)]
    assert a == b


def test_samples_follow_the_distribution():
    probs = np.array([0.5, 0.25, 0.125, 0.125])
    logits = np.log(probs).astype(np.float32)
    cfg = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    rng = np.random.default_rng(1234)
    n = 20000
    counts = np.bincount([sampling.sample(logits, cfg, rng) for _ in range(n)], minlength=4)
    chi2 = (((counts - n * probs) ** 2) / (n * probs)).sum()
    assert chi2 < 16.27  # chi-square, 3 degrees of freedom, p = 0.001


@pytest.mark.parametrize("kwargs", [{"temperature": -1.0}, {"top_k": -1}, {"top_p": 1.5}, {"min_p": 1.5}])
def test_invalid_settings_name_the_value(kwargs):
    with pytest.raises(InvalidRequestError, match=str(next(iter(kwargs.values())))):
        SamplingConfig(**kwargs)


def test_seeds_as_the_apis_send_them():
    # OpenAI takes any int64; llama.cpp's -1 means a fresh random seed (the fuzz test once found -5 a 500)
    draw = lambda seed: SamplingConfig(seed=seed).rng().integers(0, 2**32, 4).tolist()  # noqa: E731
    assert draw(-5) == draw(-5) == draw(2**64 - 5) and draw(7) == draw(7) != draw(-5)
    assert draw(-1) != draw(-1) and draw(None) != draw(None)


def test_top_p_zero_keeps_the_top_token_as_in_llama_cpp():
    logits = np.array([0.1, 2.0, 1.9, -1.0], dtype=np.float32)
    ids, p = sampling.distribution(logits, SamplingConfig(temperature=0.7, top_p=0.0, top_k=0, min_p=0.0))
    assert ids.tolist() == [1] and p.tolist() == [1.0]


# -- llama.cpp's infill sampler (llama.vim's and llama.vscode's last), run by llama.cpp itself ---------------------

def _text_tokens(m, n: int) -> list[int]:
    """`n` text tokens of `m` none of whose pieces starts another's."""
    out: list[int] = []
    for t in range(1000, m.n_vocab):
        piece = m.token_bytes(t)
        if len(piece) >= 3 and not m.is_eog(t) and all(
                not a.startswith(b) and not b.startswith(a) for b in map(m.token_bytes, out) for a in [piece]):
            out.append(t)
        if len(out) == n:
            return out
    raise AssertionError("vocabulary too small")


def _prefix_pair(m) -> tuple[int, int]:
    """Two text tokens, the first's piece a proper prefix of the second's."""
    by_piece = {m.token_bytes(t): t for t in range(1000, min(m.n_vocab, 20000)) if not m.is_eog(t)}
    for piece, t in by_piece.items():
        if len(piece) >= 3 and piece[:-1] in by_piece and len(piece[:-1]) >= 2:
            return by_piece[piece[:-1]], t
    raise AssertionError("no token is a prefix of another")


def test_infill_merges_tokens_sharing_a_prefix_and_drops_the_unlikely(smollm):
    short, long = _prefix_pair(smollm)
    x, y, z = [t for t in _text_tokens(smollm, 8)
               if not smollm.token_bytes(t).startswith(smollm.token_bytes(short))][:3]
    ids, p = np.array([y, z, short, long, x]), np.array([0.30, 0.29, 0.15, 0.14, 0.12])
    kept, q = sampling.infill(ids, p, smollm.infill_keep)
    # short + long = 0.29 clears 0.2 as one (kept under the likelier, `short`); x alone does not
    assert sorted(kept.tolist()) == sorted([y, z, short])
    np.testing.assert_allclose(q, p[[0, 1, 2]] / p[[0, 1, 2]].sum(), rtol=1e-6)  # drawn by their own probabilities


def test_infill_ends_the_turn_when_no_text_token_is_likely(smollm):
    ids = np.array(_text_tokens(smollm, 6))
    kept, q = sampling.infill(ids, np.full(6, 1 / 6), smollm.infill_keep)
    assert len(kept) == 1 and smollm.is_eog(int(kept[0])) and q.tolist() == [1.0]


def test_infill_keeps_only_the_end_when_it_is_likely_enough(smollm):
    eog = next(t for t in range(smollm.n_vocab) if smollm.is_eog(t))
    text = _text_tokens(smollm, 2)
    kept, q = sampling.infill(np.array([text[0], eog, text[1]]), np.array([0.5, 0.3, 0.2]), smollm.infill_keep)
    assert kept.tolist() == [eog] and q.tolist() == [1.0]
