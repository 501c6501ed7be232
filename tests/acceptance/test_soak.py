"""Soak: a steady load on one `gpuq serve` process; its memory levels off, nothing logged at ERROR.

The suite runs 12 s of ``gpuq bench soak`` at 1,000 jobs/s (the bench's default is
10 minutes at 300): about the jobs of a minute at 250/s, so a leak per job grows
RSS as much, and serve is warm from its first sample. Memory is a behaviour,
not a timing: RSS at the end must stay within 1.2x of RSS after the warm-up (the
first 20% of the run). A leak of 1 KiB per job (a list in serve's completer)
fails it: ratio 1.21 (1.25 over 60 s at 250/s, what the suite ran before).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from gpuq.bench.measure import count_errors, rss_mb
from gpuq.bench.soak import SoakConfig, run_soak


def test_count_errors_counts_error_lines_and_tracebacks():
    log = "\n".join([
        json.dumps({"event": "job.done", "level": "info"}),
        json.dumps({"event": "lease.failed", "level": "warning"}),
        json.dumps({"event": "boom", "level": "error"}),
        "Traceback (most recent call last):",
        "  File \"x.py\", line 1",
        "not json {",
    ])
    n, examples = count_errors(log)
    assert n == 2 and "boom" in examples[0]


def test_rss_of_this_process_is_plausible():
    assert 1 < rss_mb(os.getpid()) < 1 << 14


async def test_soak_12s_memory_levels_off_and_no_errors(dsn):
    out = await run_soak(dsn, SoakConfig(seconds=12, rate=1000, agents=3, capacity=8, sample_seconds=0.25))
    print(json.dumps(out))
    assert out["samples"] >= 30
    assert out["done"] > 0 and out["done"] == out["inserted"]
    assert out["ratio"] <= 1.2, out
    assert out["errors"] == 0, out["error_examples"]
    assert out["serve_exit"] == 0  # SIGTERM at the end: a clean drain


def test_soak_cli_prints_its_json_last(server_dsn):
    res = subprocess.run([sys.executable, "-m", "gpuq.bench.soak", "--seconds", "3", "--rate", "100",
                          "--agents", "1", "--sample-seconds", "0.5", "--database-url", server_dsn, "--yes"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    got = json.loads(res.stdout.rstrip("\n").splitlines()[-1])
    assert got["bench"] == "soak" and got["errors"] == 0 and got["done"] > 0
    assert {"rss_warm_mb", "rss_end_mb", "ratio"} <= got.keys()
