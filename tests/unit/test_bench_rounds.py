"""Benches' figures over rounds and seeds: medians, the worst beside them, every round listed."""

import argparse

from gpuq.bench import placement, producers, throughput


def _round(jobs_per_s, ratio, serve_cpu_s):
    r = {"bench": "throughput", "jobs": 1000, "agents": 4, "capacity": 64, "gpuq_jobs_per_s": jobs_per_s,
         "ratio": ratio, "serve_cpu_s": serve_cpu_s, "agents_cpu_s": 0.5, "postgres_cpu_s": 1.0,
         "pgqueuer_cpu_s": 2.0, "pgqueuer_postgres_cpu_s": 1.0, "agents_used": 4, "postgres": {}}
    r["cpu_us_per_job"] = throughput.cpu_per_job(r)
    return r


def test_throughput_rounds_report_the_median_and_the_worst():
    rounds = [_round(100.0, 1.5, 0.1), _round(300.0, 2.5, 0.3), _round(200.0, 0.9, 0.2)]
    got = throughput.summarize(rounds)
    assert (got["gpuq_jobs_per_s"], got["gpuq_jobs_per_s_worst"]) == (200.0, 100.0)
    assert (got["ratio"], got["ratio_worst"]) == (1.5, 0.9)
    assert got["agents_used"] == 4 and got["jobs"] == 1000  # the same in every round: as it is
    assert got["cpu_us_per_job"]["gpuq"] == {"serve": 200.0, "agents": 500.0, "postgres": 1000.0, "total": 1700.0}
    assert got["cpu_us_per_job"]["pgqueuer"]["total"] == 3000.0
    assert [r["gpuq_jobs_per_s"] for r in got["rounds"]] == [100.0, 300.0, 200.0]
    assert throughput.summarize(rounds[:1]) is rounds[0]


def test_placement_reports_every_seed_the_median_and_the_worst():
    args = argparse.Namespace(serves=1, agents=16, devices=4, models=12, jobs=1000, load_seconds=0.5)
    figures = dict.fromkeys(placement.FIGURES, 1.0)
    seeds = [{"seed": s, **figures, "violations": v, "cold_load_ratio": r}
             for s, v, r in ((1, 0, 0.2), (2, 1, 0.45), (3, 0, 0.3))]
    got = placement.summarize(args, seeds)
    assert (got["cold_load_ratio"], got["cold_load_ratio_worst"], got["violations"]) == (0.3, 0.45, 1)
    assert [s["seed"] for s in got["seeds"]] == [1, 2, 3]


def test_producers_report_each_round_s_ratio_and_the_worst():
    on = [{"commits_per_s": 900.0}, {"commits_per_s": 1000.0}, {"commits_per_s": 800.0}]
    off = [{"commits_per_s": 1000.0}, {"commits_per_s": 1000.0}, {"commits_per_s": 1000.0}]
    got = producers.summarize(on, off)
    assert (got["commits_per_s"], got["no_trigger_commits_per_s"], got["commit_ratio"]) == (900.0, 1000.0, 0.9)
    assert got["round_ratios"] == [0.9, 1.0, 0.8] and got["commit_ratio_worst"] == 0.8
