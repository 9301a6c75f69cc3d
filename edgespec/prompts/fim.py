"""Fill-in-the-middle prompts from the model's own FIM tokens, laid out as llama.cpp's server does.

    [<repo>myproject\\n] [<file_sep>name\\ntext]... [<file_sep>filename\\n]
    <fim_prefix>prefix+prompt <fim_suffix>suffix <fim_middle>

Repo-level tokens (repo name, file separator) are used when the model has them,
as Qwen2.5-Coder does; the prefix keeps its end and the suffix its start when
they must be cut to leave room for the answer (3:1, as llama.cpp).
"""

from __future__ import annotations

from typing import Callable, Sequence

from edgespec.gguf import Vocab
from edgespec.errors import InvalidRequestError, UnsupportedModelError

# llama.cpp separates extra chunks this way when the model has no file separator token.
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"


def infill_tokens(
    vocab: Vocab,
    tokenize: Callable[[str], list[int]],
    prefix: str,
    suffix: str,
    prompt: str = "",
    extra: Sequence[tuple[str, str]] = (),
    budget: int = 4096,
) -> list[int]:
    """The FIM prompt as token ids; `tokenize` must not add BOS or parse special tokens."""
    if vocab.fim_pre is None or vocab.fim_suf is None or vocab.fim_mid is None:
        raise UnsupportedModelError("this model has no fill-in-the-middle tokens; use a code model such as "
                                    "qwen2.5-coder-1.5b for /infill")
    head: list[int] = []
    if vocab.fim_rep is not None:
        head += [vocab.fim_rep, *tokenize("myproject\n")]
    for filename, text in extra:
        if vocab.fim_sep is not None:
            head += [vocab.fim_sep, *tokenize(filename + "\n")]
        else:
            head += tokenize(CHUNK_SEPARATOR)
        head += tokenize(text)
    if vocab.fim_sep is not None:
        head += [vocab.fim_sep, *tokenize("filename\n")]

    pre, suf, mid = tokenize(prefix), tokenize(suffix), tokenize(prompt)
    room = budget - len(head) - len(mid) - 3 - (1 if vocab.add_bos else 0)
    if room < 0:
        raise InvalidRequestError(f"input_extra and prompt take {len(head) + len(mid)} tokens, more than the "
                                  f"{budget} available for the prompt; send less extra context")
    n_pre = min(len(pre), 3 * room // 4)
    n_suf = min(len(suf), room - n_pre)
    bos = [vocab.bos] if vocab.add_bos and vocab.bos is not None else []  # after the extra context, as llama.cpp
    return [*head, *bos, vocab.fim_pre, *pre[len(pre) - n_pre:], *mid, vocab.fim_suf, *suf[:n_suf], vocab.fim_mid]
