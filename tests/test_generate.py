"""Plain decoding through the engine and the CLI, against llama-cpp-python's own output."""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from edgespec import Engine, GenerationConfig, LoadConfig, SamplingConfig
from edgespec.cli.commands import cli

CODE_PROMPT = "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"


def run_cli(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def llama_cpp_python_greedy(path, prompt: str, n: int, flash_attn: bool, n_ctx: int = 1024) -> str:
    from unittest import mock

    import llama_cpp.llama_cpp as lib
    from llama_cpp import Llama

    from edgespec.backend import amx_build, repack_without_amx
    from edgespec.config import default_threads

    keep = []

    def params():  # the weights in the buffers edgespec puts them in (an AMX build: repacked by name), so the kernels
        p = default_params()
        if amx_build():
            p.use_extra_bufts = False
            keep.append(repack_without_amx(p, path))
        return p

    threads = default_threads()  # edgespec's own default, so that both sides run alike
    default_params = lib.llama_model_default_params
    with mock.patch.object(lib, "llama_model_default_params", params):  # Llama has no argument for it
        llm = Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, flash_attn=flash_attn,
                    verbose=False)
    try:
        return llm.create_completion(prompt, max_tokens=n, temperature=0.0)["choices"][0]["text"]
    finally:
        llm.close()


# Flash attention changes the arithmetic: on an AVX2-only CPU SmolLM2's greedy output with and without it
# parts at about token 10. llama-cpp-python's Llama defaults to off, llama.cpp (and edgespec) to auto, which
# is on for these CPU models; so each setting is compared with the same setting.
@pytest.mark.parametrize("flash_attn", ["on", "off"])
@pytest.mark.parametrize("which", ["smollm_path", "qwen_draft_path"])  # two architectures, the smallest of each
def test_greedy_matches_llama_cpp_python(which, flash_attn, request):
    path = request.getfixturevalue(which)
    r = run_cli("generate", "--model", str(path), "--prompt", CODE_PROMPT, "--max-tokens", "48",
                "--ctx", "1024", "--json", "--quiet", "--proposer", "none", "--flash-attn", flash_attn)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "tokens", "finish_reason", "stats"}
    for key in ("prompt_tokens", "completion_tokens", "prefill_seconds", "decode_seconds", "tokens_per_second"):
        assert key in out["stats"]
    assert out["stats"]["completion_tokens"] == len(out["tokens"]) > 0
    assert out["text"] == llama_cpp_python_greedy(path, CODE_PROMPT, 48, flash_attn=flash_attn == "on")


def test_json_stats_and_finish_reason_length(smollm_path):
    r = run_cli("generate", "-m", str(smollm_path), "-p", "Count: one, two, three,", "-n", "7", "--json", "-q")
    out = json.loads(r.stdout)
    assert out["finish_reason"] == "length" and len(out["tokens"]) == 7
    assert out["stats"]["tokens_per_second"] > 0 and out["stats"]["prompt_tokens"] > 3


def test_chat_uses_the_model_template_and_stops_at_eos(qwen_path):
    with Engine(qwen_path, proposer="none", load=LoadConfig(n_ctx=512)) as e:
        tokens = e.chat_tokens([{"role": "user", "content": "Reply with just the word: yes"}])
        assert e.target.token_text(tokens[0]) == "<|im_start|>"
        assert "Reply with just the word: yes" in e.target.detokenize(tokens)
        out = e.generate(tokens, GenerationConfig(max_tokens=20))
        assert out.finish_reason == "stop" and "yes" in out.text.lower()


def test_seeded_sampling_is_reproducible(smollm_path):
    cfg = GenerationConfig(max_tokens=24, sampling=SamplingConfig(temperature=1.0, seed=11))
    with Engine(smollm_path, proposer="none", load=LoadConfig(n_ctx=512)) as e:
        a = e.generate("Once upon a time, a cat named Tom", cfg)
        b = e.generate("Once upon a time, a cat named Tom", cfg)
        c = e.generate("Once upon a time, a cat named Tom", GenerationConfig(max_tokens=24, sampling=SamplingConfig(
            temperature=1.0, seed=12)))
    assert len(a.tokens) == 24 and a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_stream_never_splits_a_utf8_character(qwen_path):
    with Engine(qwen_path, proposer="none", load=LoadConfig(n_ctx=512)) as e:
        tokens = e.chat_tokens([{"role": "user", "content": "List 5 rare CJK characters like 龘 and 靐 with their meanings."}])
        chunks = list(e.stream(tokens, GenerationConfig(max_tokens=40)))
        ids = [t for c in chunks for t in c.tokens]
        assert all("\ufffd" not in c.text for c in chunks)
        assert "".join(c.text for c in chunks) == e.target.detokenize(ids)
        # at least one token was an incomplete character on its own
        assert any(not _decodes(e.target.token_bytes(t)) for t in ids)


def _decodes(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_prefix_of_previous_call_is_reused(smollm_path):
    with Engine(smollm_path, proposer="none", load=LoadConfig(n_ctx=512)) as e:
        first = e.generate("The quick brown fox jumps over the lazy dog. " * 4, GenerationConfig(max_tokens=4))
        again = e.generate("The quick brown fox jumps over the lazy dog. " * 4, GenerationConfig(max_tokens=4))
    assert first.tokens == again.tokens
    # the whole prompt: the row its evaluation ended on was kept, so not even its last token is decoded again
    assert again.stats.cached_prompt_tokens == again.stats.prompt_tokens


def test_the_engine_pads_prompt_batches_as_its_calibrated_curve_prices_them(smollm_path):
    with Engine(smollm_path, load=LoadConfig(n_ctx=512)) as e:
        rate = e.prompt_rate
        assert rate.known and rate.batches[:5] == (1, 2, 3, 4, 7)  # the sizes timed for prompts only are there
        assert [e.target.padded(n) for n in range(1, 80)] == [rate.padded(n) for n in range(1, 80)]


def test_a_calibration_timed_while_other_processes_take_its_cores_is_used_but_not_cached(smollm_path, tmp_path):
    """Cached, a timing taken under someone else's load would price every later run's prompts as dear as then."""
    from edgespec.backend import Model
    from edgespec.decoding.costs import Contention, calibrate

    with Contention() as probe:
        pass
    # one busy loop per CPU this process may run on (inherited: under pytest-xdist, this worker's own core)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in probe.cpus]
    try:
        with Model(smollm_path, LoadConfig(n_ctx=512)) as m:
            costs = calibrate(m, None, 3, tmp_path)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert len(costs.target_seconds) == 3 and all(t > 0 for t in costs.target_seconds)
    assert not list(tmp_path.iterdir())


def test_a_generation_cancelled_before_it_begins_leaves_the_cache_as_it_was(smollm_path):
    # A warm-up preempted before its turn came: it must not evict what the next request reuses.
    import threading

    with Engine(smollm_path, proposer="none", load=LoadConfig(n_ctx=512)) as e:
        e.generate("The quick brown fox jumps over the lazy dog. " * 4, GenerationConfig(max_tokens=4))
        held = list(e.slots[0].cache.tokens)
        cancel = threading.Event()
        cancel.set()
        chunks = list(e.stream("A different text altogether, " * 8, GenerationConfig(max_tokens=0), (), cancel))
        assert chunks[-1].finish_reason == "cancelled"
        assert list(e.slots[0].cache.tokens) == held


def test_a_generation_past_its_deadline_ends_at_its_first_token(smollm_path):
    # An editor's answer is due at a time (GenerationConfig.deadline): a prompt that took past it leaves one token.
    import time

    with Engine(smollm_path, proposer="none", load=LoadConfig(n_ctx=512)) as e:
        prompt = "Count to fifty: one, two, three,"
        free = e.generate(prompt, GenerationConfig(max_tokens=8, time_limit=60.0))
        due = e.generate(prompt, GenerationConfig(max_tokens=8, time_limit=60.0, deadline=time.perf_counter()))
        assert free.stats.completion_tokens == 8 and due.stats.completion_tokens == 1
        assert due.finish_reason == "length" and due.tokens == free.tokens[:1]


def test_no_cycle_starts_that_would_end_past_the_time_limit_cap(smollm_path, monkeypatch):
    """t_max_predict_ms ends a line that runs on where it would run as long again past the limit: on a clock where
    every cycle takes 125 ms, a limit of 250 ms (a cap at 500) keeps the cycle that ends at 500 and no later one."""
    import itertools
    import types

    from edgespec.engine import generation

    with Engine(smollm_path, proposer="none", load=LoadConfig(n_ctx=512)) as e:
        prompt = "Count to fifty: one, two, three,"
        free = e.generate(prompt, GenerationConfig(max_tokens=12))
        ticks = itertools.count()
        monkeypatch.setattr(generation, "time", types.SimpleNamespace(perf_counter=lambda: 1 + next(ticks) * 0.125))
        capped = e.generate(prompt, GenerationConfig(max_tokens=12, time_limit=0.25))
        assert "\n" not in e.target.detokenize(free.tokens[:6])  # no newline ends it first
        assert capped.tokens == free.tokens[:5] and capped.finish_reason == "length"  # first token at 0, last at 0.5


@pytest.mark.parametrize("prompt, whole", [("Items:\n- apples\n- pears\n- plums\n", True),
                                           ("Q: What is 2+2?\nA: 4\nQ: What is the capital of France?\nA:", False),
                                           ("x = 1\ny = 2\nz = 3\n", False)])
def test_past_the_time_limit_the_line_under_way_after_whole_lines_is_dropped(smollm_path, monkeypatch, prompt,
                                                                             whole):
    """Past t_max_predict_ms, once whole lines with WHOLE_LINES_MIN_CHARS visible characters have ended, the line
    under way is dropped, not run on to its end or the cap: the answer comes at the limit in whole lines. On a clock
    where every cycle takes 125 ms, the limit falls just after the first line's newline (token j); a first line
    with less text (a number, a blank line) runs on to the cap as before."""
    import itertools
    import types

    from edgespec.config import WHOLE_LINES_MIN_CHARS
    from edgespec.engine import generation

    with Engine(smollm_path, proposer="none", load=LoadConfig(n_ctx=512)) as e:
        free = e.generate(prompt, GenerationConfig(max_tokens=16))
        text = lambda tokens: e.target.detokenize(tokens)  # noqa: E731
        j = next(j for j in range(len(free.tokens)) if text(free.tokens[:j + 1]).endswith("\n"))
        assert (len("".join(text(free.tokens[:j]).split())) >= WHOLE_LINES_MIN_CHARS) == whole
        cap = 2 * j + 2  # tokens up to the cap, as long again past the limit: no cycle starts that would end past it
        assert "\n" not in text(free.tokens[j + 1:j + 2 if whole else cap])  # no newline ends it first
        ticks = itertools.count()
        monkeypatch.setattr(generation, "time", types.SimpleNamespace(perf_counter=lambda: 1 + next(ticks) * 0.125))
        limited = e.generate(prompt, GenerationConfig(max_tokens=16, time_limit=(j + 0.5) * 0.125))
        assert limited.tokens == free.tokens[:j + 1 if whole else cap] and limited.finish_reason == "length"


@pytest.mark.parametrize(
    "args, message",
    [
        (["-m", "/nonexistent/model.gguf"], "does not exist"),
        (["-m", "no-such-model"], "neither an existing file nor a catalog name"),
        (["--ctx", "256", "-p", "word " * 400], "the prompt has"),
        (["-n", "-2"], "max_tokens -2 must be >= 0"),
        (["-t", "-2"], "temperature -2.0"),
        (["--threads", "0"], "thread count 0 must be >= 1; leave --threads out"),
    ],
)
def test_bad_input_gives_one_clear_line(args, message, smollm_path):
    argv = ["generate", "-m", str(smollm_path), "-p", "hi", "-q", *args]
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 1
    assert message in r.stderr
    assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1
    assert "Traceback" not in r.output


@pytest.mark.parametrize("content", [b"not a model at all", "truncated"])
def test_bad_files_in_a_real_process(content, tmp_path, smollm_path):
    bad = tmp_path / "bad.gguf"
    if content == "truncated":
        bad.write_bytes(smollm_path.read_bytes()[: 10 * 2**20])
    else:
        bad.write_bytes(content)
    p = subprocess.run([sys.executable, "-m", "edgespec.cli", "generate", "-m", str(bad), "-p", "hi", "-q"],
                       capture_output=True, text=True)
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and str(bad) in lines[0], p.stderr


def test_prompt_bytes_that_are_not_utf8_read_as_replacement_characters(smollm_path, tmp_path):
    """Invalid bytes from a shell (argv), a file or stdin are U+FFFD, as a terminal shows them."""
    bad = b"\x01\x02\xff\xfe ok"
    base = [sys.executable, "-m", "edgespec.cli", "generate", "-m", str(smollm_path), "-n", "2", "--json", "-q"]
    (tmp_path / "p.txt").write_bytes(bad)
    runs = [subprocess.run([*base, "-p", os.fsdecode(bad)], capture_output=True),
            subprocess.run([*base, "-f", str(tmp_path / "p.txt")], capture_output=True),
            subprocess.run([*base[:3], "complete", *base[4:-2], "-q"], input=bad, capture_output=True)]
    for p in runs:  # nothing on stderr but the calibration's note that a busy machine kept it from the cache
        assert p.returncode == 0 and all(line.startswith(b"WARNING edgespec.decoding.costs: costs of ")
                                         for line in p.stderr.splitlines()), p.stderr
    same = subprocess.run([*base, "-p", "\x01\x02\ufffd\ufffd ok"], capture_output=True)
    assert json.loads(runs[0].stdout)["tokens"] == json.loads(runs[1].stdout)["tokens"] == \
        json.loads(same.stdout)["tokens"]


def test_a_line_that_repeats_one_of_the_given_lines_ends_the_generation_before_it(smollm_path):
    """An infill's answer ends before a line that repeats the text below the cursor (GenerationConfig.repeats): the
    lines before it go out whole, the repeated line and what follows do not, and no token is generated past it."""
    with Engine(smollm_path, proposer="none", load=LoadConfig(n_ctx=512)) as e:
        prompt = "Items:\n- apples\n- pears\n- plums\n"
        free = e.generate(prompt, GenerationConfig(max_tokens=32))
        lines = free.text.split("\n")
        k = next(k for k in range(1, len(lines) - 1) if lines[k] not in lines[:k])  # given below: no line before it
        stopped = e.generate(prompt, GenerationConfig(max_tokens=32, repeats=(f"  {lines[k]} ",)))
        assert stopped.text == "".join(line + "\n" for line in lines[:k]) and stopped.finish_reason == "length"
        assert stopped.tokens == free.tokens[:len(stopped.tokens)] and len(stopped.tokens) < len(free.tokens)
        assert e.target.detokenize(stopped.tokens).endswith(lines[k] + "\n")  # decided at the repeat's newline
