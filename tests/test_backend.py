"""The llama.cpp backend on real GGUF files: facts, tokens, logits rows, KV trimming, bad files, weight buffers."""

import logging
import re

import numpy as np
import pytest

from edgespec import gguf
from edgespec.backend import Model, amx_build
from edgespec.config import LoadConfig
from edgespec.decoding import reuse
from edgespec.decoding.loop import planned
from edgespec.engine.slots import Slot, SlotPool
from edgespec.errors import ContextOverflowError, InvalidModelError, ModelNotFoundError


def test_facts_of_smollm(smollm):
    f = smollm.facts
    assert f.architecture == "llama"
    assert (f.n_layer, f.n_head_kv, f.head_dim_k) == (30, 3, 64)
    assert smollm.n_vocab == 49152
    assert f.weights_bytes > 50 * 2**20
    assert f.chat_template and "im_start" in f.chat_template
    assert not f.recurrent and smollm.can_trim


def test_qwen_pair_shares_one_vocabulary(qwen_path, qwen_draft_path):
    with Model(qwen_path, LoadConfig(n_ctx=256)) as t, Model(qwen_draft_path, LoadConfig(n_ctx=256)) as d:
        assert (t.facts.n_layer, t.facts.n_head_kv, t.facts.head_dim_k) == (28, 2, 128)
        assert t.vocab == d.vocab
        assert t.vocab.eos == 151645 and t.n_vocab == 151936
        assert t.vocab.fim_pre is not None and t.vocab.fim_suf is not None and t.vocab.fim_mid is not None
        text = "def add(a: int, b: int) -> int:\n    return a + b  # ünïcode ✓"
        assert t.tokenize(text) == d.tokenize(text)
        assert t.detokenize(t.tokenize(text)) == text


def test_decode_returns_only_the_requested_rows(smollm):
    smollm.trim(0)
    prompt = smollm.tokenize("The capital of France is")
    rows = smollm.decode(prompt, n_outputs=3)
    assert rows.shape == (3, smollm.n_vocab) and rows.dtype == np.float32
    assert smollm.n_past == len(prompt) == smollm.pos_max() + 1


def test_batched_rows_match_one_token_at_a_time(smollm):
    tokens = smollm.tokenize("def fibonacci(n):\n    if n < 2:")
    smollm.trim(0)
    batched = smollm.decode(tokens, n_outputs=len(tokens)).copy()
    smollm.trim(0)
    single = np.stack([smollm.decode([t])[-1].copy() for t in tokens])
    # Different kernels for batches: equal up to float noise, same argmax.
    np.testing.assert_allclose(batched, single, atol=0.05)
    assert (batched.argmax(1) == single.argmax(1)).all()


def test_batched_rows_of_qwen_move_the_top_two_gap_by_less_than_the_near_tie_bound(qwen_path):
    """The premise of the greedy-equality tests (test_speculative.NEAR_TIE_GAP)."""
    from test_speculative import NEAR_TIE_GAP

    with Model(qwen_path, LoadConfig(n_ctx=512)) as m:
        toks = m.tokenize(open(__file__).read())[:165]
        m.decode(toks[:120])
        worst = 0.0
        for b in (3, 5, 9):
            for s in range(120, 165 - b, b):
                m.trim(s)
                batched = m.decode(toks[s : s + b], n_outputs=b).copy()
                m.trim(s)
                single = np.stack([m.decode([t])[-1].copy() for t in toks[s : s + b]])
                for r in range(b):
                    lo, hi = np.argsort(single[r])[-2:]
                    shift = abs((single[r, hi] - single[r, lo]) - (batched[r, hi] - batched[r, lo]))
                    worst = max(worst, float(shift))
    assert 0 < worst < NEAR_TIE_GAP


def test_trim_then_regenerate_gives_the_same_logits(smollm):
    tokens = smollm.tokenize("Once upon a time, in a small village,")
    smollm.trim(0)
    first = smollm.decode(tokens)[-1].copy()
    assert smollm.decode([42, 43, 44], n_outputs=0).shape == (0, smollm.n_vocab)
    assert smollm.trim(len(tokens) - 1) == 4
    assert smollm.pos_max() == len(tokens) - 2 and smollm.tokens == tokens[:-1]
    again = smollm.decode(tokens[-1:])[-1]
    np.testing.assert_array_equal(first, again)


def test_a_padded_batch_keeps_its_own_tokens_and_the_rows_they_get_alone(smollm, monkeypatch):
    """Model.padded: filler after a batch is evaluated with it and dropped; the cache, its positions and the rows
    asked for are the batch's alone (up to the kernels' float noise), and where the filler would not fit the
    context the batch goes unpadded."""
    tokens = smollm.tokenize("def fibonacci(n):\n    if n < 2:\n        return")
    smollm.trim(0)
    alone = smollm.decode(tokens, n_outputs=2).copy()
    monkeypatch.setattr(smollm, "padded", lambda n: n + 5)
    smollm.trim(0)
    padded = smollm.decode(tokens, n_outputs=2).copy()
    assert smollm._batch.n_tokens == len(tokens) + 5  # the pass ran with the filler
    assert smollm.tokens == tokens and smollm.pos_max() == len(tokens) - 1
    np.testing.assert_allclose(padded, alone, atol=0.05)
    assert (padded.argmax(1) == alone.argmax(1)).all()
    smollm.decode(tokens[:1])
    assert smollm.pos_max() == len(tokens)  # the next token right after them
    smollm.trim(0)
    smollm.decode([1] * (smollm.n_ctx - 3))
    smollm.decode([1, 2, 3])  # 3 cells left, no room for 5 more
    assert smollm._batch.n_tokens == 3 and smollm.n_past == smollm.n_ctx == smollm.pos_max() + 1
    smollm.trim(0)


def test_every_pass_runs_on_one_thread_whichever_thread_asks(smollm, monkeypatch):
    """edgespec.compute: llama.cpp's OpenMP build gives each thread that decodes a team of workers of its own, and
    teams that outnumber the CPUs slow every pass; so a decode asked for on the main thread and one asked for on a
    worker thread (a server slot's) both run on the one compute thread, with the same rows."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from edgespec import backend

    seen, real = [], backend.llama_cpp.llama_decode
    monkeypatch.setattr(backend.llama_cpp, "llama_decode",
                        lambda ctx, batch: seen.append(threading.get_ident()) or real(ctx, batch))
    tokens = smollm.tokenize("def fibonacci(n):")

    def decoded() -> tuple[np.ndarray, int]:
        smollm.trim(0)
        return smollm.decode(tokens).copy(), threading.get_ident()

    here, main = decoded()
    with ThreadPoolExecutor(1) as pool:
        there, worker = pool.submit(decoded).result()
    assert len(seen) == 2 and seen[0] == seen[1] and seen[0] not in (main, worker)
    np.testing.assert_array_equal(here, there)
    smollm.trim(0)


def test_shared_prefix_and_keep_prefix_of(smollm):
    smollm.trim(0)
    smollm.decode([10, 11, 12, 13])
    assert smollm.shared_prefix([10, 11, 12, 13, 14]) == 4  # the cache is a prefix: nothing to redo
    assert smollm.shared_prefix([10, 11, 12, 13]) == 3  # the last token is decoded again for its logits
    assert smollm.shared_prefix([10, 11, 99, 13, 14]) == 2
    assert smollm.shared_prefix([]) == 0
    assert smollm.keep_prefix_of([10, 11, 99]) == 2
    assert smollm.tokens == [10, 11] and smollm.pos_max() == 1


def test_a_prompt_evaluated_again_gets_the_row_its_evaluation_ended_on_while_its_positions_stay(smollm):
    # n_cmpl's other completions and a regenerate start from the row the prompt's evaluation ended on, as
    # llama-server's parallel completions share one; a change at or before the prompt's last position drops it.
    seq = smollm.sequences[0]
    prompt = smollm.tokenize("Once upon a time, in a small village,")
    seq.trim(0)
    ended = seq.evaluate(prompt)[-1].copy()
    seq.decode([42, 43, 44])  # a completion written after it; rolled back past the prompt by prompt_row
    row = seq.prompt_row(prompt)
    assert row is not None and row.shape == (1, smollm.n_vocab) and seq.tokens == prompt
    np.testing.assert_array_equal(row[0], ended)
    row[0, 0] = 1e9  # the caller's copy: the kept row stays as computed
    np.testing.assert_array_equal(seq.prompt_row(prompt)[0], ended)
    assert seq.prompt_row(prompt[:-1]) is None and seq.prompt_row([*prompt, 42]) is None
    assert seq.prompt_row([*prompt[:-1], prompt[-1] + 1]) is None  # same length, other text
    seq.trim(len(prompt) - 1)  # the last position dropped: its row goes with it
    assert seq.prompt_row(prompt) is None
    seq.decode(prompt[-1:])  # evaluated again by a decode, not an evaluation: no row is kept for it
    assert seq.prompt_row(prompt) is None
    seq.evaluate(prompt, [(0, 0, len(prompt) - 1)])
    assert seq.prompt_row(prompt) is not None
    seq.evaluate([*prompt[:3], 7, 8], [(0, 0, 3)])  # another prompt that keeps only the first positions
    seq.evaluate(prompt, [(0, 0, 3)])
    assert seq.prompt_row(prompt) is not None  # evaluated afresh from position 3, its new row


def test_an_abort_ends_a_background_batch_in_flight_and_only_such_a_batch(smollm):
    """Model.abort (a request preempting background work) ends the abortable batch within a graph node: llama.cpp
    drops that batch, the batches before it stay. A decode that is not background work ignores it."""
    smollm.trim(0)
    text = list(range(100, 400))
    armed = smollm._arm

    def abort_as_it_starts(abortable: bool) -> None:  # the abort arrives while the second batch runs
        armed(abortable)
        if abortable and smollm.n_past >= 64:
            smollm.abort()

    smollm._arm = abort_as_it_starts
    try:
        assert smollm.sequences[0].decode(text, 1, stop=lambda: False, step=64) is None
    finally:
        smollm._arm = armed
    assert smollm.tokens == text[:64] and smollm.pos_max() == 63
    smollm.abort()  # a stray abort: the next decode that is not background work runs whole
    assert smollm.decode(text[64:], 1) is not None and smollm.n_past == len(text)


def test_an_abort_never_cuts_the_re_rotation_of_moved_entries(smollm, caplog):
    """The decode after a move (chunk reuse) first re-rotates the moved keys, one layer at a time. Aborted there,
    llama.cpp keeps the shift pending and rotates the layers already done once more at the next decode: the cache
    is wrong from then on. So background work decodes that batch whole (one token), and the abort of a request
    that preempts it ends the batch after it. The prompt then evaluates to what it does without the abort."""
    s = smollm.sequences[0]
    text = smollm.tokenize("def area(width: float, height: float) -> float:\n    return width * height\n" * 4,
                           add_special=False)
    moved = [*text[:10], *smollm.tokenize(" # a line put in before the rest, which moves\n", add_special=False),
             *text[10:]]

    def evaluated(stop=None, step=None):
        runs = [(r.start, r.source, r.length) for r in reuse.plan(s.tokens, moved, 16).runs]
        assert len(runs) == 2 and runs[1][0] > runs[1][1]  # the common prefix, and the rest of `text` moved on
        return s.evaluate(moved, runs, 1, stop, step)

    s.trim(0)
    s.evaluate(text)
    expected = np.array(evaluated()[0])
    s.trim(0)
    s.evaluate(text)
    armed = smollm._arm

    def abort_at_once(abortable: bool) -> None:  # a request preempts every abortable batch as it starts
        armed(abortable)
        if abortable:
            smollm.abort()

    smollm._arm = abort_at_once
    try:
        with caplog.at_level(logging.DEBUG, logger="edgespec.llama_cpp"):
            assert evaluated(stop=lambda: False, step=16) is None
    finally:
        smollm._arm = armed
    said = [r.getMessage() for r in caplog.records]
    assert "update: applying K-shift" in said and not [m for m in said if "failed to compute K-shift" in m]
    assert s.tokens == [*moved[:11], *text[10:-1]]  # one token evaluated, then the run moved back after it
    np.testing.assert_allclose(evaluated()[0], expected, atol=0.1)  # as if no abort had come


def test_context_overflow_is_refused_without_damage(smollm):
    smollm.trim(0)
    smollm.decode(smollm.tokenize("hello"))
    before = list(smollm.tokens)
    with pytest.raises(ContextOverflowError, match="context of 512"):
        smollm.decode([1] * 600)
    assert smollm.tokens == before and smollm.pos_max() == len(before) - 1


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        Model(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(InvalidModelError, match="not a GGUF file"):
        Model(p)


def test_truncated_gguf(tmp_path, smollm_path):
    p = tmp_path / "truncated.gguf"
    with open(smollm_path, "rb") as src, open(p, "wb") as dst:
        dst.write(src.read(smollm_path.stat().st_size // 2))
    with pytest.raises(InvalidModelError, match="truncated, corrupt"):
        Model(p)


def test_a_gguf_cut_inside_its_metadata_is_refused_by_name(tmp_path, qwen_draft_path):
    p = tmp_path / "cut.gguf"
    with open(qwen_draft_path, "rb") as f:
        p.write_bytes(f.read(4096))  # inside the vocabulary
    with pytest.raises(InvalidModelError, match="truncated"):
        gguf.tensors(p)
    with pytest.raises(InvalidModelError, match="truncated"):
        Model(p)


def test_gemma_loads_with_its_own_vocabulary(gemma_path):
    with Model(gemma_path, LoadConfig(n_ctx=256)) as g:
        assert g.facts.architecture == "gemma3"
        assert g.n_vocab > 200_000
        assert g.detokenize(g.tokenize("hello world", add_special=False)) == "hello world"


def test_weights_read_into_memory_survive_the_file_being_overwritten_in_place(tmp_path, smollm_path):
    """A mapped file truncated under a running model is SIGBUS; `mmap=False` (what serve uses) must not be."""
    import shutil
    import subprocess
    import sys
    import textwrap

    copy = tmp_path / "m.gguf"
    shutil.copy(smollm_path, copy)
    script = textwrap.dedent(f"""
        import os
        from edgespec.backend import Model
        from edgespec.config import LoadConfig
        m = Model({str(copy)!r}, LoadConfig(n_ctx=64, mmap=False))
        tokens = m.tokenize("The capital of France is")
        before = m.decode(tokens).argmax()
        os.truncate({str(copy)!r}, 0)  # as `cp other.gguf m.gguf` does first
        os.posix_fadvise(os.open({str(copy)!r}, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
        m.trim(0)
        print(before == m.decode(tokens).argmax())
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stdout) == (0, "True\n"), p.stderr[-2000:]


def test_a_batch_smaller_than_the_sequences_is_raised_to_them(smollm_path):
    # llama.cpp needs an output row per sequence (the slots and the park sequences) in a batch: asked for less, it
    # aborted the process at context creation (GGML_ASSERT n_outputs_max), as a timing run with B = 1, 2, 4 did.
    with Model(smollm_path, LoadConfig(n_ctx=256, n_batch=4)) as m:
        assert m.n_batch >= 9
        prompt = m.tokenize("The capital of France is")
        assert m.decode(prompt).shape == (1, m.n_vocab) and m.n_past == len(prompt)


@pytest.mark.parametrize("which", ["smollm_path", "qwen_draft_path", "gemma_path", "qwen_path"])
def test_the_tensor_directory_is_read_as_the_gguf_package_reads_it(which, request):
    import gguf as reference

    path = request.getfixturevalue(which)
    mine = [(t.name, t.ggml_type, t.shape) for t in gguf.tensors(path)]
    theirs = [(t.name, int(t.tensor_type), tuple(int(n) for n in t.shape)) for t in reference.GGUFReader(path).tensors]
    assert mine == theirs and len(mine) > 200


def test_only_layer_matrices_of_a_repackable_type_go_to_the_repack_buffer():
    t = gguf.Tensor
    listing = [t("token_embd.weight", 12, (1536, 151936)),  # read as rows, never multiplied
               t("blk.0.attn_q.weight", 12, (1536, 1536)), t("blk.0.ffn_down.weight", 14, (8960, 1536)),  # Q6_K
               t("blk.0.attn_norm.weight", 0, (1536,)), t("blk.1.ffn_up.weight", 2, (1536, 8960)),
               t("blk.1.attn_k.weight", 20, (1536, 256)), t("blk.2.attn_v.weight", 12, (1536, 260)),  # 260 % 8
               t("blk.3.ffn_gate_exps.weight", 12, (1536, 512, 8))]
    pattern = gguf.repack_pattern(listing)
    assert [x.name for x in listing if re.search(pattern, x.name)] == \
        ["blk.0.attn_q.weight", "blk.1.ffn_up.weight", "blk.1.attn_k.weight"]
    assert not re.search(pattern, "blk.0.attn_q.weight.extra") and not re.search(pattern, "blk.10.attn_q.weight")
    assert gguf.repack_pattern(listing[:1]) is None
    # with layers on a GPU, only those left on the CPU: llama.cpp offloads the last ones, the output layer first
    moved = [x.name for x in listing if re.search(gguf.repack_pattern(listing, gpu_layers=3), x.name)]
    assert moved == ["blk.0.attn_q.weight", "blk.1.ffn_up.weight", "blk.1.attn_k.weight"]  # blk 0-3 and the output
    assert gguf.repack_pattern(listing, gpu_layers=1) == pattern and gguf.repack_pattern(listing, 999) is None


def test_an_amx_build_repacks_the_weights_without_amx(qwen_draft_path, caplog):
    """llama.cpp's AMX kernels crash in a GCC 12 build (backend.amx_build), and its switch for them turns off
    repacking too; edgespec names the repackable weights instead. Elsewhere llama.cpp's own default holds."""
    with caplog.at_level(logging.DEBUG, logger="edgespec.llama_cpp"), Model(qwen_draft_path, LoadConfig(n_ctx=256)):
        pass
    moved = [r.getMessage() for r in caplog.records if "buffer type overridden to CPU_REPACK" in r.getMessage()]
    names = {m.split()[1] for m in moved}
    if amx_build():
        pattern = gguf.repack_pattern(gguf.tensors(qwen_draft_path))
        assert names == {t.name for t in gguf.tensors(qwen_draft_path) if re.search(pattern, t.name)} and names
    else:
        assert not moved


def test_the_re_rotation_a_move_costs_is_timed_in_the_empty_aside_and_leaves_it_empty(smollm_path, gemma_path):
    """A move's price (decoding.costs.PromptRate.shift) is timed once at load: llama.cpp re-rotates every cell of
    the context whatever the sequences hold, so the aside, empty then, times it for all. None where nothing moves."""
    with Model(smollm_path, LoadConfig(n_ctx=512)) as m:
        assert SlotPool([Slot(m.sequences[0], None)], m.aside).rerotation_seconds() is None  # no aside
    with Model(gemma_path, LoadConfig(n_ctx=512, aside=256)) as m:
        assert m.aside is None and not m.can_shift  # a sliding-window cache: no parks, no aside, no move
    with Model(smollm_path, LoadConfig(n_ctx=512, aside=256)) as m:
        slot = Slot(m.sequences[0], None)
        text = m.tokenize("def area(width: float, height: float) -> float:\n", add_special=False)
        slot.cache.evaluate(text)
        seconds = SlotPool([slot], m.aside).rerotation_seconds()
        assert seconds is not None and seconds >= 0.0
        assert m.aside.tokens == [] and m.aside.pos_max() == -1  # nothing of the probe is left
        assert slot.cache.tokens == text and slot.cache.pos_max() == len(text) - 1  # nor moved in the slot


def test_a_slot_takes_the_aside_whole_only_where_it_leaves_less_to_evaluate(smollm_path):
    """The aside is built beside the slot, sharing none of its cells: the slot then moves its own (chunk reuse,
    which moves a cell in every sequence holding it) and the aside still holds what it evaluated. A slot takes the
    aside by exchanging sequences; it keeps its index, and the cache continues as one that evaluated it all."""
    with Model(smollm_path, LoadConfig(n_ctx=512)) as m:
        assert m.aside is None  # the Python API's default; `edgespec serve` sets ASIDE_TOKENS apart
    with Model(smollm_path, LoadConfig(n_ctx=512, aside=256)) as m:
        slot = Slot(m.sequences[0], None, index=0)
        pool = SlotPool([slot], m.aside)
        text = m.tokenize("def area(width: float, height: float) -> float:\n    return width * height\n" * 3,
                          add_special=False)
        typed = m.tokenize("\ndef volume(", add_special=False)
        slot.cache.evaluate(text)
        assert pool.build_aside(text, lambda: False, lambda left: min(left, 8)) and pool.aside.tokens == text
        moved = [*text[:10], *m.tokenize(" # a line put in\n", add_special=False), *text[10:]]
        runs = [(r.start, r.source, r.length) for r in reuse.plan(slot.cache.tokens, moved, 16).runs]
        assert len(runs) == 2 and runs[1][0] > runs[1][1]  # the slot moves its cells after the first 10
        slot.cache.evaluate(moved, runs)
        assert pool.aside.pos_max() == len(text) - 1 and pool.aside.tokens == text
        held = slot.cache
        pool.adopt(slot, lambda c: planned(c, moved + typed).new)  # the slot holds that one: it stays
        assert slot.cache is held
        pool.adopt(slot, lambda c: planned(c, text + typed).new)
        assert slot.cache is not held and slot.cache.tokens == text and slot.index == 0
        assert pool.aside is held and held.tokens == [] and held.pos_max() == -1
        rows = np.array(slot.cache.decode(typed, 1)[0])
        held.decode(text, 0, lambda: False, 8)  # the same tokens evaluated afresh in another sequence, as the aside
        fresh = np.array(held.decode(typed, 1)[0])
        # equal but for where llama.cpp put the cells (the old slot's, freed, take the new tokens): that moves this
        # tiny model's logits by about 3% of their range; a cache with wrong positions or keys moves them far more
        assert rows.argmax() == fresh.argmax() and np.abs(rows - fresh).max() < 0.06 * np.abs(fresh).max()
