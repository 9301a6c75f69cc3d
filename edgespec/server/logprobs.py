"""Token log-probabilities in the three shapes clients read: OpenAI chat's, OpenAI completions' (legacy) and
llama.cpp's completion_probabilities. The numbers are the target's own (sampling.logprob)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from edgespec.decoding.sampling import TokenLogprob

Piece = Callable[[int], bytes]  # a token's bytes (the model's token_piece)


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _entry(piece: Piece, token: int, logprob: float) -> dict[str, Any]:
    data = piece(token)
    return {"token": _text(data), "logprob": logprob, "bytes": list(data)}


def chat(lps: Sequence[TokenLogprob], piece: Piece) -> dict[str, Any]:
    """choices[].logprobs of /v1/chat/completions (a stream's chunk carries its own tokens)."""
    return {"content": [_entry(piece, lp.token, lp.logprob)
                        | {"top_logprobs": [_entry(piece, t, p) for t, p in lp.top]} for lp in lps],
            "refusal": None}


def completions(lps: Sequence[TokenLogprob], piece: Piece, offset: int = 0) -> dict[str, Any]:
    """choices[].logprobs of /v1/completions, OpenAI's legacy shape; `offset` is the text before these tokens."""
    tokens, offsets = [], []
    for lp in lps:
        offsets.append(offset)
        text = _text(piece(lp.token))
        tokens.append(text)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{_text(piece(t)): p for t, p in lp.top} for lp in lps], "text_offset": offsets}


def llama(lps: Sequence[TokenLogprob], piece: Piece) -> list[dict[str, Any]]:
    """llama.cpp's completion_probabilities (its default, probabilities before the samplers): chat's entries
    with the token id."""
    return [{"id": lp.token} | _entry(piece, lp.token, lp.logprob)
            | {"top_logprobs": [{"id": t} | _entry(piece, t, p) for t, p in lp.top]} for lp in lps]
