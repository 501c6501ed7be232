"""Protocol fuzzing with hypothesis against a live server: 1,000 frames in the suite."""

from gpuq.bench import fuzz

EXAMPLES = 1000


def test_fuzzed_frames_are_all_answered_and_change_no_job(dsn):
    figures = fuzz.run_fuzz(dsn, EXAMPLES)
    assert figures["examples"] >= EXAMPLES
    assert figures["healthy_agent_served"] is True
    assert figures["jobs_changed"] == 0
    # The fuzzer really reached the closing paths too (binary, oversized, bad hello ...).
    assert sum(figures["closes"].values()) > 0
