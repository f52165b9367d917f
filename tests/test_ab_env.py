"""benchmarks/ab_env.py: variants of one build in alternating fresh processes, one session
file rewritten after every run (real subprocesses; the benchmark here is a tiny script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Writes what its process saw: the variant's setting, and a run number from a shared file.
_BENCH = """
import json, os, sys
counter = sys.argv[2]
n = int(open(counter).read()) + 1 if os.path.exists(counter) else 1
open(counter, "w").write(str(n))
if os.environ.get("AB_FAIL") == "1" and n == 4:  # variant a in round 2 (order a b, b a)
    print("failing on purpose"); sys.exit(3)
json.dump({"setting": os.environ.get("AB_SETTING"), "run": n}, open(sys.argv[1], "w"))
"""


def _ab_env(tmp_path, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "bench.py"
    script.write_text(_BENCH)
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "ab_env.py"), *args, "--",
         sys.executable, str(script), "{json}", str(tmp_path / "count")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_ab_env_alternates_variants_and_keeps_every_run(tmp_path):
    out = tmp_path / "session.json"
    proc = _ab_env(
        tmp_path, "--out", str(out), "--rounds", "3",
        "--variant", "old:AB_SETTING=1", "--variant", "new:AB_SETTING=2,OTHER=x",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    session = json.loads(out.read_text())
    assert session["variants"] == {
        "old": {"AB_SETTING": "1"},
        "new": {"AB_SETTING": "2", "OTHER": "x"},
    }
    runs = session["runs"]
    assert {r: d["setting"] for r, d in runs["old"].items()} == {"r1": "1", "r2": "1", "r3": "1"}
    assert {r: d["setting"] for r, d in runs["new"].items()} == {"r1": "2", "r2": "2", "r3": "2"}
    # Order: old new | new old | old new.
    order = sorted((d["run"], name) for name in runs for d in runs[name].values())
    assert [name for _, name in order] == ["old", "new", "new", "old", "old", "new"]
    assert session["failures"] == []


def test_ab_env_records_a_failed_run_and_goes_on(tmp_path):
    out = tmp_path / "session.json"
    proc = _ab_env(
        tmp_path, "--out", str(out), "--rounds", "2",
        "--variant", "a:AB_SETTING=1,AB_FAIL=1", "--variant", "b:AB_SETTING=2",
    )  # fmt: skip
    assert proc.returncode == 1
    session = json.loads(out.read_text())
    (failure,) = session["failures"]
    assert (failure["variant"], failure["round"], failure["exit"]) == ("a", 2, 3)
    assert "failing on purpose" in failure["tail"]
    assert sorted(session["runs"]["a"]) == ["r1"] and sorted(session["runs"]["b"]) == ["r1", "r2"]


def test_ab_env_refuses_bad_variants(tmp_path):
    out = str(tmp_path / "s.json")
    for bad in (["--variant", "a:X=1"], ["--variant", "a", "--variant", "b:NOEQUALS"],
                ["--variant", "a", "--variant", "a:X=1"]):  # fmt: skip
        proc = _ab_env(tmp_path, "--out", out, *bad)
        assert proc.returncode == 2, (bad, proc.stdout, proc.stderr)
    assert not os.path.exists(out)
