"""The GPU kit, run on the CPU: scripts/gpu_kit.py packs SmolLM2-135M's layout, scripts/gpu_proof.py --cpu runs
every step but CUDA on real llama-cpp-python, resumes, names missing parts, and survives a crashing check; the
planner takes a measured curve for the device it was measured on and the published one for any other."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgespec.planning import placement

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
STEPS = ("kit", "wheels", "llama", "ggufs", "crash", "timing", "lockstep", "replay", "onnx", "curves")
CRASH_CHECKS = ("imports", "layout", "load-default", "load-no-mmap", "load-no-repack", "load-no-mmap-no-repack",
                "load-gpu", "load-edgespec", "load-edgespec-preload", "completion-default", "completion-no-mmap",
                "script-segv", "backtrace")


def script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], check=False, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def kit(tmp_path_factory, smollm_path) -> Path:
    """SmolLM2's skeleton as target and draft, no sdist (the test uses the installed llama-cpp-python), in parts of
    at most 1 MiB, laid out for calls of 3 MiB: so over several call folders."""
    out = tmp_path_factory.mktemp("kit") / "kit"
    done = script(SCRIPTS / "gpu_kit.py", "pack", out, "--target", smollm_path, "--draft", smollm_path, "--no-sdist",
                  "--part-mib", "1", "--call-mib", "3", "--tree-mib", "0")
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def proof(kit, tmp_path_factory) -> dict:
    """Two calls of the whole kit with --cpu, a check that segfaults added to the crash checks."""
    tmp = tmp_path_factory.mktemp("proof")
    segv = tmp / "segv.py"
    segv.write_text("import ctypes\nctypes.string_at(0)\n")
    out = tmp / "out"
    cmd = (SCRIPTS / "gpu_proof.py", "--cpu", "--installed", "--threads", "1", "--kit", kit, "--out", out,
           "--check-script", segv)
    first = script(*cmd)
    mtimes = {p: p.stat().st_mtime for p in (out / "steps").rglob("*.json") if p.name != "kit.json"}
    t = time.monotonic()
    second = script(*cmd)
    return {"out": out, "first": first, "second": second, "mtimes": mtimes, "second_seconds": time.monotonic() - t}


def step(proof: dict, name: str) -> dict:
    return json.loads((proof["out"] / "steps" / f"{name}.json").read_text())


def test_the_kit_names_every_part_and_lays_them_out_by_call(kit):
    manifest = json.loads((kit / "manifest.json").read_text())
    roles = sorted(f["role"] for f in manifest["files"])
    assert roles == ["draft-sidecar", "draft-skeleton", "target-sidecar", "target-skeleton", "wheel", "wheel"]
    skeleton = next(f for f in manifest["files"] if f["role"] == "target-skeleton")
    assert len(skeleton["parts"]) == 2 and sum(p["size"] for p in skeleton["parts"]) == skeleton["size"]
    assert len(manifest["calls"]) > 1 and all(c["bytes"] <= 2 << 20 for c in manifest["calls"])
    for entry in manifest["files"]:
        for part in entry["parts"]:
            assert (kit / part["folder"] / part["name"]).stat().st_size == part["size"] <= 1 << 20
    for call in manifest["calls"]:  # any one folder that arrives says what the kit is
        assert json.loads((kit / call["folder"] / "manifest.json").read_text()) == manifest


def test_missing_and_damaged_parts_are_named_with_their_sizes(kit, tmp_path):
    manifest = json.loads((kit / "manifest.json").read_text())
    partial = tmp_path / "kit"
    shutil.copytree(kit / "call-1", partial / "call-1")  # only the first call has arrived, one part damaged
    damaged = next(p for p in sorted((partial / "call-1").iterdir()) if p.name != "manifest.json")
    damaged.write_bytes(bytes([damaged.read_bytes()[0] ^ 1]) + damaged.read_bytes()[1:])
    absent = [(p["folder"], p["name"], p["size"]) for f in manifest["files"] for p in f["parts"]
              if p["folder"] != "call-1"]
    assert absent
    done = script(SCRIPTS / "gpu_proof.py", "--cpu", "--installed", "--kit", partial, "--out", tmp_path / "out")
    assert done.returncode == 2, done.stdout + done.stderr
    for folder, name, size in absent:
        assert f"missing {folder}/{name} ({size:,} bytes)" in done.stdout
    assert f"damaged call-1/{damaged.name} ({damaged.stat().st_size:,} bytes): sha256 differs" in done.stdout
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["steps"]["kit"]["status"] == "incomplete"
    assert "waiting" in results["steps"]["ggufs"]["why"] or "incomplete" in results["steps"]["ggufs"]["why"]
    checked = script(SCRIPTS / "gpu_kit.py", "check", partial)
    assert checked.returncode == 1 and f"missing {absent[0][0]}/{absent[0][1]}" in checked.stdout


def test_every_step_writes_its_result(proof):
    first = proof["first"]
    assert first.returncode == 0, first.stdout + first.stderr
    results = json.loads((proof["out"] / "results.json").read_text())
    assert list(results["steps"]) == list(STEPS)
    for name in STEPS:
        r = step(proof, name)
        assert r["status"] in ("ok", "skipped"), (name, r)
        assert results["steps"][name]["status"] == r["status"]
    assert step(proof, "llama")["status"] == "skipped" and "--installed" in step(proof, "llama")["reason"]
    timing = step(proof, "timing")
    assert timing["target"]["batches"] == [1, 2, 3, 4, 6, 8, 12, 16] and timing["target"]["ratio"][0] == 1.0
    modes = step(proof, "lockstep")["answer"]["modes"]
    assert list(modes) == ["none", "auto", "draft:2", "draft:4", "draft:8", "ngram"]
    for k in (2, 4, 8):  # the target as its own draft: greedy proposals the target makes itself
        assert modes[f"draft:{k}"]["drafted"] > 0 and modes[f"draft:{k}"]["acceptance"] > 0.8
    replay = step(proof, "replay")["answer"]
    assert replay["label"].startswith("REPLAYED") and set(replay["speedup_over_plain"]["greedy Spec-Bench"]) == {
        "k2", "k4", "k8", "auto"}
    onnx = step(proof, "onnx")["answer"]
    assert isinstance(onnx["per_token_ms"]["fp32 cpu"], float) and onnx["live"]["tokens"] > 0
    (curve,) = step(proof, "curves")["devices"].values()
    assert curve["kind"] == "cpu" and curve["batches"] == timing["target"]["batches"]


def test_the_crash_checks_answer_in_order_and_a_crash_is_recorded_not_fatal(proof):
    crash = json.loads((proof["out"] / "crash.json").read_text())
    assert tuple(crash["order"]) == CRASH_CHECKS
    checks = crash["checks"]
    for name in CRASH_CHECKS:
        assert checks[name]["status"] in ("ok", "skipped", "crashed"), (name, checks[name])
        if checks[name]["status"] == "skipped":
            assert checks[name]["reason"]  # never skipped without saying why
    assert checks["imports"]["status"] == "ok" and checks["imports"]["libllama"]
    assert checks["load-default"]["status"] == "ok" and checks["load-default"]["answer"]["decode_rc"] == 0
    assert checks["load-gpu"]["reason"].startswith("--cpu")
    for name in ("load-edgespec", "load-edgespec-preload"):  # edgespec's own load, as the measurements make it
        assert checks[name]["status"] == "ok" and checks[name]["answer"]["decode_rc"] == 0, checks[name]
    assert step(proof, "timing")["ld_preload"] is None  # nothing preloaded where edgespec's load survives
    segv = checks["script-segv"]
    assert segv["status"] == "crashed" and segv["signal"] == "SIGSEGV"
    assert any("string_at" in line for line in segv["faulthandler"])
    trace = checks["backtrace"]
    if trace["status"] == "ok":
        assert trace["of"] == "script-segv" and "SIGSEGV" in trace["backtrace"][0]
    else:
        assert trace["reason"] == "neither gdb nor cuda-gdb is on PATH"
    assert "no crash on this machine" in crash["verdict"] and "script-segv crashed (SIGSEGV)" in crash["verdict"]
    assert step(proof, "timing")["status"] == "ok"  # the kit went on after the crash


def test_a_second_call_runs_nothing_again(proof):
    second = proof["second"]
    assert second.returncode == 0, second.stdout + second.stderr
    for name in STEPS[1:]:
        assert f"[{name}] done before, not run again" in second.stdout
    assert all(p.stat().st_mtime == m for p, m in proof["mtimes"].items())
    assert proof["second_seconds"] < 30


def test_measured_curves_merge_into_the_table_and_the_planner_reads_them(proof, tmp_path):
    table = tmp_path / "measured_curves.json"
    shutil.copyfile(placement.MEASURED_CURVES, table)
    before = json.loads(table.read_text())["devices"]
    done = script(SCRIPTS / "gpu_proof.py", "curves", proof["out"] / "results.json", "--into", table)
    assert done.returncode == 0, done.stderr
    after = json.loads(table.read_text())["devices"]
    assert {k: after[k] for k in before} == before  # the devices measured before stay as they were
    (name, entry), = ((k, v) for k, v in after.items() if k not in before)
    at = dict(zip(entry["batches"], entry["ratio"]))
    expected = tuple(at[b] for b in (1, 2, 4, 8, 16))  # the calibration sizes measured, in order
    assert placement.gpu_curve(entry["kind"], name, placement.measured_curves(table)) == expected
    assert json.loads(placement.MEASURED_CURVES.read_text())["devices"] == before  # the repository's copy: untouched


def test_a_measured_curve_replaces_the_published_one_for_its_device_only(tmp_path, monkeypatch):
    table = tmp_path / "measured_curves.json"
    table.write_text(json.dumps({"format": 1, "devices": {
        "NVIDIA H100 80GB HBM3": {"kind": "cuda", "batches": [1, 2, 3, 4, 8, 16, 32, 64],
                                  "ratio": [1.0, 1.01, 1.02, 1.03, 1.1, 1.3, 1.9, 3.2]},
        "Apple M2 Pro": {"kind": "metal", "batches": [1, 2, 4, 8], "ratio": [1.0, 1.05, 1.2, 1.6]},
        "No B=2": {"kind": "cuda", "batches": [1, 4], "ratio": [1.0, 1.5]}}}))
    monkeypatch.setattr(placement, "MEASURED_CURVES", table)
    assert placement.gpu_curve("cuda", "nvidia h100 80gb hbm3 ") == (1.0, 1.01, 1.03, 1.1, 1.3, 1.9, 3.2)
    assert placement.gpu_curve("metal", "Apple M2 Pro") == (1.0, 1.05, 1.2, 1.6)  # as far as it was measured
    assert placement.gpu_curve("cuda", "NVIDIA GeForce RTX 4090") == (1.0, 1.119, 1.331, 2.146)  # published
    assert placement.gpu_curve("cuda", "No B=2") == (1.0, 1.119, 1.331, 2.146)  # one size is no curve
    assert placement.gpu_curve("metal", "Apple M3 Max") == (1.0, 1.112, 1.405, 2.160)
    # 1.2 GB on the GPU at 60% of 2 TB/s is 1 ms a pass, plus 29 layers of 110 us launches.
    split = placement.Split(gpu_bytes=1_200_000_000, host_bytes=0, gpu_layers=29)
    h100 = placement.modelled_seconds(split, "cuda", 2000e9, "NVIDIA H100 80GB HBM3")
    assert h100 == pytest.approx([0.001 * r + 29 * 110e-6 for r in (1.0, 1.01, 1.03, 1.1, 1.3, 1.9, 3.2)])
    other = placement.modelled_seconds(split, "cuda", 2000e9, "NVIDIA A100-SXM4-80GB")
    assert other == pytest.approx([0.001 * r + 29 * 110e-6 for r in (1.0, 1.119, 1.331, 2.146)])
