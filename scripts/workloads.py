"""Benchmark prompts: Spec-Bench questions (../shared/bench) and a code-editing set from real source files.

The code-editing set asks the model to rewrite real standard-library functions
(type hints, docstrings, renames): the answer repeats most of the prompt, which
is the workload editors send and where prompt lookup pays.
"""

from __future__ import annotations

import colorsys
import difflib
import heapq
import html
import inspect
import json
import shlex
import statistics
import string
import textwrap
import urllib.parse
from pathlib import Path

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "bench" / "spec_bench_questions.jsonl"
CATEGORIES = ("translation", "summarization", "qa", "math_reasoning", "rag", "writing", "coding")

EDIT_TASKS = (
    "Add type hints to every parameter and return value of this function. Reply with only the complete updated code.",
    "Add a Google-style docstring to this function. Reply with only the complete updated code.",
    "Rename the function's local variables to longer, descriptive names. Reply with only the complete updated code.",
)
EDIT_SOURCES = (textwrap.indent, statistics.median, difflib.get_close_matches, shlex.split, urllib.parse.urljoin,
                heapq.nlargest, statistics.variance, textwrap.wrap)
# Functions no benchmark in this repository was tuned on (bench_spec.py --held-out), of the same range of lengths.
HELD_OUT_SOURCES = (string.capwords, colorsys.rgb_to_hls, html.escape, statistics.mode, statistics.stdev,
                    statistics.quantiles, urllib.parse.urlsplit, statistics.fmean)


def spec_bench(per_category: int, path: Path = SPEC_BENCH, skip: int = 0) -> list[tuple[str, str]]:
    """(category, first turn) for `per_category` questions of each category, after its first `skip`."""
    seen: dict[str, int] = {}
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        q = json.loads(line)
        cat = q["category"]
        if cat in CATEGORIES:
            seen[cat] = seen.get(cat, 0) + 1
            if skip < seen[cat] <= skip + per_category:
                out.append((cat, q["turns"][0]))
    return out


def code_edits(n: int, sources: tuple = EDIT_SOURCES) -> list[tuple[str, str]]:
    out = []
    for i, fn in enumerate(sources[:n]):
        source = inspect.getsource(fn)
        out.append(("code-edit", f"{EDIT_TASKS[i % len(EDIT_TASKS)]}\n\n```python\n{source}```"))
    return out
