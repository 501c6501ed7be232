"""Each bench in a tiny configuration: it runs, and its last stdout line is its JSON.

No timing is asserted here: figures belong in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from gpuq import bench


def run_bench(capsys: pytest.CaptureFixture[str], dsn: str, *argv: str) -> dict[str, Any]:
    """Parse argv as ``gpuq bench ...`` would, run it on ``dsn``, return its JSON line."""
    parser = argparse.ArgumentParser(prog="gpuq bench")
    bench.register(parser)
    args = parser.parse_args([*argv, "--database-url", dsn, "--yes"])
    assert args.bench(args) == 0
    out = capsys.readouterr().out
    last = out.rstrip("\n").splitlines()[-1]
    return json.loads(last)


def test_lease_history_json(server_dsn: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "lease.png"
    got = run_bench(capsys, server_dsn, "lease-history", "--done", "0,2000", "--batch", "8",
                    "--repeat", "3", "--plot", str(png))
    assert got["bench"] == "lease-history" and got["batch"] == 8
    assert [r["done"] for r in got["rows"]] == [0, 2000]
    for row in got["rows"]:
        assert {"done", "gpuq_buffers", "gpuq_ms", "naive_buffers", "naive_ms"} <= row.keys()
        assert row["gpuq_buffers"] > 0 and row["naive_buffers"] > 0
        # gpuq finds its rows through the pending partial index, never the primary key.
        assert "jobs_pending_idx" in row["gpuq_scans"]
        assert "jobs_fair_idx" in row["gpuq_fair_scans"] and row["fair_reads_buffers"] > 0
    assert isinstance(got["gpuq_buffer_ratio"], float) and isinstance(got["gpuq_fair_buffer_ratio"], float)
    assert png.stat().st_size > 1000


def test_raw_json(server_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    got = run_bench(capsys, server_dsn, "raw", "--jobs", "500", "--batch", "16", "--workers", "2")
    assert got["bench"] == "raw" and got["jobs"] == 500
    assert got["raw_jobs_per_s"] > 0


def test_explicit_database_needs_yes(server_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="gpuq bench")
    bench.register(parser)
    args = parser.parse_args(["raw", "--jobs", "10", "--database-url", server_dsn])
    assert args.bench(args) == 2
    err = capsys.readouterr().err
    assert "DROPS" in err and "--yes" in err


def test_throughput_json_with_pgqueuer(server_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("pgqueuer")
    pytest.importorskip("psutil")
    got = run_bench(capsys, server_dsn, "throughput", "--jobs", "300", "--agents", "1",
                    "--capacity", "16", "--compare", "pgqueuer", "--pgq-workers", "1")
    assert got["bench"] == "throughput" and got["jobs"] == 300
    assert {"gpuq_jobs_per_s", "pgqueuer_jobs_per_s", "ratio", "raw_jobs_per_s",
            "fraction_of_raw", "serve_cpu_s"} <= got.keys()
    assert got["agents_used"] == 1
    cpu = got["cpu_us_per_job"]
    assert set(cpu) == {"gpuq", "pgqueuer"}
    assert set(cpu["gpuq"]) == {"serve", "agents", "postgres", "total"}
    assert set(cpu["pgqueuer"]) == {"consumers", "postgres", "total"}
    assert cpu["gpuq"]["serve"] == round(got["serve_cpu_s"] * 1e6 / 300, 1)


def test_latency_json(server_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("psutil")
    got = run_bench(capsys, server_dsn, "latency", "--rate", "50", "--seconds", "1",
                    "--agents", "1")
    assert got["bench"] == "latency" and got["jobs"] == 50
    assert {"gpuq_p50_ms", "gpuq_p90_ms", "gpuq_p99_ms", "gpuq_max_ms"} <= got.keys()
    assert "pgqueuer_p50_ms" not in got


def test_agents_json(server_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("psutil")
    got = run_bench(capsys, server_dsn, "agents", "--agents", "20", "--per-process", "10",
                    "--jobs", "200")
    assert got["bench"] == "agents" and got["agents"] == 20
    assert {"agents", "serve_rss_mb", "jobs_per_s", "connect_s", "agents_used"} <= got.keys()
    assert got["every_agent_got_work"] is True


def test_snapshot_json(server_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    got = run_bench(capsys, server_dsn, "snapshot", "--pending", "3000", "--jobs", "2000", "--batch", "64")
    assert got["bench"] == "snapshot" and got["jobs"] == 2000
    assert {"buffers_start", "buffers_end", "buffer_ratio", "lease_ms_start", "lease_ms_end", "jobs_per_s",
            "no_snapshot_buffer_ratio", "no_snapshot_jobs_per_s"} <= got.keys()


def test_throughput_with_an_old_snapshot_json(server_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("psutil")
    got = run_bench(capsys, server_dsn, "throughput", "--jobs", "500", "--agents", "1", "--capacity", "16",
                    "--no-raw", "--old-snapshot")
    assert {"gpuq_jobs_per_s", "tail_ratio", "snapshot_jobs_per_s", "snapshot_ratio",
            "snapshot_tail_ratio"} <= got.keys()


def test_producers_json(server_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("psutil")
    got = run_bench(capsys, server_dsn, "producers", "--producers", "2", "--seconds", "0.5", "--agents", "1",
                    "--rounds", "1")
    assert {"commits_per_s", "no_trigger_commits_per_s", "commit_ratio", "consumed", "rounds"} <= got.keys()
    assert got["consumed"] is True


def test_control_json(server_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    got = run_bench(capsys, server_dsn, "control", "--jobs", "3", "--progress-jobs", "200", "--rounds", "1")
    assert {"cancel_p50_ms", "cancel_p99_ms", "wait_p50_ms", "wait_p99_ms", "lost", "progress_throughput_ratio",
            "plain_jobs_per_s", "progress_jobs_per_s", "progress_rows"} <= got.keys()
    assert got["lost"] == 0


def test_batching_json(server_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    got = run_bench(capsys, server_dsn, "batching", "--agents", "2", "--capacity", "2", "--jobs", "300",
                    "--unbatched-jobs", "20", "--max-items", "16", "--open-jobs", "4", "--rates", "100",
                    "--fixed-ms", "2")
    assert {"batched_jobs_per_s", "unbatched_jobs_per_s", "speedup", "ideal_jobs_per_s", "ideal_fraction",
            "ceiling_jobs_per_s", "noop_jobs_per_s", "ceiling_fraction", "batched_mean_items", "cpu_us_per_job",
            "open_loop", "poison_extra_attempts", "cancelled_ran", "cost_violations", "lost"} <= got.keys()
    assert (got["poison_extra_attempts"], got["cancelled_ran"], got["cost_violations"], got["lost"]) == (0, 0, 0, 0)
    assert set(got["open_loop"]["100"]) == {"batched", "unbatched"}

def test_placement_json(server_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    got = run_bench(capsys, server_dsn, "placement", "--agents", "2", "--devices", "2", "--models", "3",
                    "--jobs", "12", "--load-seconds", "0.01", "--rate", "200", "--seeds", "3")
    assert {"violations", "cold_loads_per_1000", "blind_cold_loads_per_1000", "cold_load_ratio", "p99_wait_s",
            "jobs_per_s", "blind_jobs_per_s", "cold_load_ratio_worst"} <= got.keys()
    assert got["violations"] == 0
    assert [s["seed"] for s in got["seeds"]] == [3]
    ratios = [s["cold_load_ratio"] for s in got["seeds"] if s["cold_load_ratio"] is not None]
    if ratios:
        assert got["cold_load_ratio_worst"] == max(ratios)


def test_placement_over_two_serves_json(server_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    got = run_bench(capsys, server_dsn, "placement", "--serves", "2", "--agents", "2", "--devices", "2",
                    "--models", "3", "--jobs", "12", "--load-seconds", "0.01", "--rate", "200", "--seeds", "1")
    assert got["serves"] == 2 and got["violations"] == 0
    assert {"cold_loads_per_1000", "blind_cold_loads_per_1000", "cold_load_ratio"} <= got.keys()


def test_fairness_json(server_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    got = run_bench(capsys, server_dsn, "fairness", "--seconds", "1", "--window", "0.5", "--flood", "300",
                    "--tenants", "20", "--leases", "10")
    assert {"trickle_p99_wait_ms", "fifo_trickle_p99_wait_ms", "share_error_max", "share_error_mixed_max",
            "idle_tenant_utilisation", "jain_1000", "lease_p99_ratio_1000"} <= got.keys()
    assert got["trickle_jobs"] == 2 and 0 < got["idle_tenant_utilisation"] <= 1
    assert 0 < got["jain_1000"] <= 1 and 0 <= got["share_error_max"] <= 1 and got["lease_p99_ratio_1000"] > 0
    # b's jobs waited behind a's flood without fair share: far longer than with it.
    assert got["fifo_trickle_p99_wait_ms"] > got["trickle_p99_wait_ms"]


def test_busy_json(server_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    got = run_bench(capsys, server_dsn, "busy", "--agents", "2", "--jobs", "20", "--sleep-ms", "5")
    assert {"busy_fraction_async", "busy_fraction_sync", "gap_p50_ms", "gap_p99_ms", "duplicate_starts",
            "busy_fraction_async_no_prefetch", "busy_fraction_sync_no_prefetch", "gap_p50_ms_no_prefetch",
            "gap_p99_ms_no_prefetch", "busy_fraction_reported_async", "busy_fraction_reported_sync_no_prefetch"
            } <= got.keys()
    assert got["duplicate_starts"] == 0
    assert 0 < got["busy_fraction_async"] <= 1 and 0 < got["busy_fraction_sync"] <= 1
    assert 0 < got["busy_fraction_reported_async"] <= 1


def test_throughput_with_a_dashboard_open_json(server_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("psutil")
    got = run_bench(capsys, server_dsn, "throughput", "--jobs", "500", "--agents", "1", "--capacity", "16",
                    "--no-raw", "--dashboard")
    assert {"gpuq_jobs_per_s", "dashboard_jobs_per_s", "dashboard_ratio", "dashboard_serve_cpu_s",
            "dashboard_pages", "dashboard_fragments"} <= got.keys()
    assert got["dashboard_pages"] >= 4 and got["dashboard_fragments"] >= 1  # it did watch


def test_failover_json(capsys: pytest.CaptureFixture[str]) -> None:
    """Synchronous and read-only failovers at a tiny size: every key, nothing lost, the verdict OK."""
    from gpuq.bench.failover import KEYS
    from tests.helpers import need_replica_tools

    need_replica_tools()
    parser = argparse.ArgumentParser(prog="gpuq bench")
    bench.register(parser)
    args = parser.parse_args(["failover", "--variants", "sync,readonly", "--seconds", "3", "--promote-after", "1",
                              "--rate", "20", "--waiters", "2", "--wait-timeout", "15", "--drain-timeout", "20"])
    code = args.bench(args)
    out = capsys.readouterr().out
    got = json.loads(out.rstrip("\n").splitlines()[-1])
    assert got["bench"] == "failover" and list(got["variants"]) == ["sync", "readonly"]
    for variant, figures in got["variants"].items():
        assert set(KEYS) <= figures.keys(), variant
        assert figures["enqueued"] > 0 and figures["recovery_s"] is not None, (variant, figures)
        for key in ("lost", "id_mismatch", "not_done", "wrong", "serve_exits", "agent_exits", "waiters_failed"):
            assert figures[key] == 0, (variant, key, figures)
    assert code == 0, out


def test_preempt_json(server_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    got = run_bench(capsys, server_dsn, "preempt", "--steps", "40", "--step-ms", "2", "--checkpoint-every", "10",
                    "--interruptions", "1", "--interrupt-min", "0.02", "--interrupt-max", "0.05", "--jobs", "3",
                    "--prefetch", "2", "--urgent", "1", "--grace", "2")
    assert {"preempt_p99_ms", "returned_after_notice_s", "redone_steps_max", "output_equal", "attempts_used",
            "urgent_wait_p99_s", "lost"} <= got.keys()
    assert got["lost"] == 0 and got["output_equal"] is True and got["attempts_used"] == 1
    assert got["returned_jobs"] == 2 and got["interruptions"] == 1
