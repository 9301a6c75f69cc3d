"""The benchmarks' pure parts: the ngram-map-k model, the two-source oracle, the tree bound, and which of an
answer's completions the editor shows (no models loaded)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_editor  # noqa: E402
import bench_fim_layout  # noqa: E402
import replay_auto  # noqa: E402
import replay_memory  # noqa: E402

from edgespec.gguf import Vocab  # noqa: E402
from edgespec.memory import Memory  # noqa: E402
from edgespec.proposers.memory import MemoryProposer  # noqa: E402

CURVE = {1: 1.0, 2: 1.71, 4: 2.7, 8: 4.58, 16: 5.31, 32: 9.09, 64: 16.3}


def _tokens(n: int, seed: int, lo: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(lo, lo + 5000) for _ in range(n)]


def test_map_k_verifies_nothing_without_a_repeated_key():
    prompt, out = _tokens(200, 1), _tokens(60, 2, lo=9000)
    assert replay_auto.map_k_one(prompt, out, CURVE) == len(out) - 1  # one plain step per token after the first


def test_map_k_copies_48_tokens_after_a_12_token_key():
    source = _tokens(120, 3)
    prompt = _tokens(50, 4, lo=20000) + source
    out = source[:100]  # the answer copies the prompt's span
    cost = replay_auto.map_k_one(prompt, out, CURVE)
    # No key until 12 tokens are out; then 48-token drafts, each accepted whole, at t(49) interpolated.
    assert cost < 0.6 * (len(out) - 1)
    assert cost > 11  # the first 11 steps are plain: the key is not yet long enough


def test_two_source_oracle_is_lookup_oracle_without_memory_and_cheaper_with_it():
    prompt, out = _tokens(80, 5), _tokens(90, 6, lo=30000)
    with_empty_memory = replay_auto.oracle_one(prompt, out, CURVE, [MemoryProposer(lambda t: False, Memory(None))])
    alone = replay_auto.oracle_one(prompt, out, CURVE)
    assert with_empty_memory == alone and alone[0] == len(out) - 1
    memory = Memory(None)
    memory.add(prompt[-32:] + out)  # the same answer written before
    assert replay_auto.oracle_one(prompt, out, CURVE, [MemoryProposer(lambda t: False, memory)])[0] < 0.5 * alone[0]


def test_replay_prices_memory_only_for_the_mode_that_reads_it():
    prompt, out = _tokens(40, 7), _tokens(120, 8, lo=40000)
    row = {"workload": "w", "prompt": prompt, "output": out}
    data = {"rows": [dict(row, mode="auto", entries_before=0), dict(row, mode="auto", entries_before=1)],
            "memory_entries": [prompt[-32:] + out]}
    n, plain_auto, with_memory, lookup_oracle, both_oracle, tree = replay_memory.replay(data, CURVE)["w"]
    assert n == 2 * (len(out) - 1)
    assert plain_auto == lookup_oracle == n  # nothing in either prompt repeats: plain steps only
    assert with_memory < 0.8 * plain_auto  # the second generation copies the remembered answer
    assert tree <= both_oracle <= with_memory


def test_tree_bound_takes_the_branch_that_holds_where_the_memory_takes_the_most_frequent():
    prompt, out = _tokens(40, 9), _tokens(100, 10, lo=50000)
    assert replay_memory.tree_bound_one(prompt, out, CURVE, []) == len(out) - 1  # nothing repeats: plain steps
    # Two earlier answers that part from this one at token 20 the same way, and one that is this one.
    entries = [prompt[-32:] + out[:20] + [7] + _tokens(70, seed, lo=60000) for seed in (11, 12)]
    entries.insert(1, prompt[-32:] + out)
    memory = Memory(None)
    for e in entries:
        memory.add(e)
    oracle, _ = replay_auto.oracle_one(prompt, out, CURVE, [MemoryProposer(lambda t: False, memory)])
    tree = replay_memory.tree_bound_one(prompt, out, CURVE, entries)
    # At token 20 the memory proposes what two of three places continue with (wrong); a branch on the third holds.
    assert tree < 0.9 * oracle
    assert tree == replay_memory.tree_bound_one(prompt, out, CURVE, [prompt[-32:] + out])


def _cursor(typed: str, after: list[str]) -> bench_editor.Cursor:
    return bench_editor.Cursor("f.py", 3, len(typed), "def f():\n", "\n".join(["", *after]) + "\n", typed,
                               len(typed) - len(typed.lstrip()), "", not typed.strip())


def test_the_editor_shows_the_first_completion_it_does_not_discard():
    c = _cursor("    x = ", ["    y = x + 1", "    return y"])
    results = [{"content": "\n", "timings": {"prompt_n": 7}}, {"content": "   "}, {"content": "2\n"}]
    kept = bench_editor.kept_completion(c, results)
    assert kept["content"] == "2\n" and kept["timings"] == {"prompt_n": 7}  # the answer's timings, shared


def test_a_completion_that_repeats_the_next_lines_is_discarded_as_llama_vscode_does():
    c = _cursor("    ", ["    y = x + 1", "    return y"])
    assert bench_editor._discarded(["y = x + 1"], c.typed, ["    y = x + 1", "    return y"])  # the next line again
    assert bench_editor._discarded(["", "    y = x + 1"], c.typed, ["    y = x + 1", "    return y"])
    assert bench_editor._discarded(["y = x + 1", "    ret"], c.typed, ["    y = x + 1", "    return y"])
    assert not bench_editor._discarded(["y = x + 2"], c.typed, ["    y = x + 1", "    return y"])
    assert not bench_editor._discarded(["y = 1"], c.typed, ["", ""])  # nothing follows: never discarded
    only = [{"content": " "}, {"content": ""}]
    assert bench_editor.kept_completion(c, only) is only[0]  # none kept: the first, as the editor shows nothing


def test_the_editor_benchmark_counts_a_files_first_completions_apart():
    # A file's first COLD_FIRST completions meet a cold cache; the summary says how many right ones came there.
    def fim(where: str, agree: int) -> bench_editor.Record:
        return bench_editor.Record("fim", where, 0.5, 10, 0, "", "", 2.0, agree)

    fims = [fim("a.py:10:4", 5), fim("a.py:10:9", 0), fim("a.py:11:4", 4), fim("a.py:11:8", 9),
            fim("b.py:3:0", 3), fim("b.py:3:6", 12), fim("b.py:4:0", 1), fim("b.py:4:4", 4)]
    assert bench_editor.COLD_FIRST == 3
    assert bench_editor.right(fims) == "5/8 (3 + 2)"  # a.py: 2 of its first 3, then 1; b.py: 1, then 1


def test_the_chunk_picked_on_entering_a_file_holds_none_of_the_lines_the_visit_writes(tmp_path: Path):
    # --buf-enter: both editors pick a chunk around the cursor when a file is entered, before the visit writes.
    path = tmp_path / "f.py"
    path.write_text("".join(f"line{i}\n" for i in range(200)))
    chunk = bench_editor.entered_chunk(path, 100, 8)
    lines = chunk["text"].splitlines()
    assert len(lines) == bench_editor.RING_CHUNK_LINES and chunk["filename"] == str(path)
    assert not {f"line{i}" for i in range(100, 108)} & set(lines)  # the visit's own lines are not there yet
    assert set(lines) <= {f"line{i}" for i in range(68, 140)}  # from around the cursor
    assert bench_editor.entered_chunk(path, 100, 8)["text"] == chunk["text"]  # seeded: runs repeat
    short = tmp_path / "g.py"
    short.write_text("a\nb\nc\nd\n")
    assert bench_editor.entered_chunk(short, 1, 1)["text"] == "a\nc\nd\n"  # a file shorter than a chunk, whole


def test_the_fim_replays_anchor_with_reuse_is_the_line_before_the_prompts_end():
    """--cache-reuse: in a middle layout's prompt the cursor is the prompt's end, so the suffix before <fim_middle> may
    move, and the line before the cursor line (after <fim_middle>) may not."""
    pre, suf, mid = 1001, 1002, 1003
    vocab = Vocab(n_tokens=2000, type=2, bos=None, eos=1, add_bos=False, fim_pre=pre, fim_suf=suf, fim_mid=mid,
                  fim_pad=None, fim_rep=None, fim_sep=None)
    piece = lambda t: chr(t).encode() if t < 1000 else b""  # noqa: E731
    chars = lambda text: [ord(c) for c in text]  # noqa: E731
    lines = [pre, *chars("a\n"), suf, *chars("s1\ns2\n"), mid, *chars("n1\nn2\n  x")]
    assert lines[bench_fim_layout.typed_end_anchor(lines, vocab, piece):] == chars("n2\n  x")
    typed = [pre, *chars("a\n"), suf, *chars("s1\n"), mid, *chars("  x")]
    assert bench_fim_layout.typed_end_anchor(typed, vocab, piece) == typed.index(mid) + 1
    assert bench_fim_layout.typed_end_anchor(chars("no fim\n"), vocab, piece) is None
