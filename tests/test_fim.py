"""The FIM prompt layout on a literal vocabulary (characters as tokens)."""

import pytest

from edgespec.gguf import Vocab
from edgespec.errors import InvalidRequestError, UnsupportedModelError
from edgespec.prompts.fim import infill_tokens

PRE, SUF, MID, REP, SEP = 1001, 1002, 1003, 1004, 1005
QWEN_LIKE = Vocab(n_tokens=2000, type=2, bos=None, eos=1, add_bos=False, fim_pre=PRE, fim_suf=SUF,
                  fim_mid=MID, fim_pad=None, fim_rep=REP, fim_sep=SEP)


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_repo_level_layout_as_llama_cpp():
    toks = infill_tokens(QWEN_LIKE, chars, "ab", "yz", prompt="P", extra=[("u.py", "T")])
    expected = [REP, *chars("myproject\n"), SEP, *chars("u.py\n"), *chars("T"), SEP, *chars("filename\n"),
                PRE, *chars("ab"), *chars("P"), SUF, *chars("yz"), MID]
    assert toks == expected


def test_cuts_keep_the_prefix_end_and_the_suffix_start():
    plain = Vocab(**{**QWEN_LIKE.__dict__, "fim_rep": None, "fim_sep": None})
    toks = infill_tokens(plain, chars, "0123456789", "abcdefghij", budget=11)  # room 8: 6 prefix, 2 suffix
    assert toks == [PRE, *chars("456789"), SUF, *chars("ab"), MID]


def test_model_without_fim_tokens_is_refused():
    with pytest.raises(UnsupportedModelError, match="fill-in-the-middle"):
        infill_tokens(Vocab(**{**QWEN_LIKE.__dict__, "fim_pre": None}), chars, "a", "b")


def test_extra_context_larger_than_the_budget_is_a_clear_400():
    with pytest.raises(InvalidRequestError, match="send less extra context"):
        infill_tokens(QWEN_LIKE, chars, "a", "b", extra=[("big.py", "x" * 500)], budget=100)
