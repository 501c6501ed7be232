"""The tenant rules and shares (gpuq.tenants) and how the CLI prints them: no database."""

import pytest

from gpuq.cli.status import render_status
from gpuq.cli.tenant import render
from gpuq.tenants import check_half_life, check_tenant, check_weight, is_tenant, with_shares


def _row(tenant: str, usage: float, weight: float = 1.0, running: int = 0, pending: int = 0) -> dict:
    return {"tenant": tenant, "weight": weight, "weighted": weight != 1.0, "usage": usage, "running": running,
            "pending": pending}


def test_shares_are_parts_of_the_usage_and_fair_shares_parts_of_the_active_tenants_weights():
    a, b, idle, waiting = with_shares([_row("a", 30, weight=3), _row("b", 10, running=1), _row("idle", 0, weight=5),
                                       _row("waiting", 0, pending=2)])
    assert (a.share, b.share, idle.share, waiting.share) == (0.75, 0.25, 0.0, 0.0)
    assert (a.fair_share, b.fair_share, idle.fair_share, waiting.fair_share) == (0.6, 0.2, 0.0, 0.2)
    nobody = with_shares([_row("idle", 0, weight=2)])[0]
    assert (nobody.share, nobody.fair_share) == (0.0, 0.0)  # no usage and no work: nothing to divide
    assert a.as_dict() == {"tenant": "a", "weight": 3, "weighted": True, "usage_gpu_seconds": 30, "running": 0,
                           "pending": 0, "share": 0.75, "fair_share": 0.6}


def test_names_weights_and_half_lives_are_checked():
    assert is_tenant("team-a/prod:eu_1.x") and is_tenant("default")
    for bad in ("", "a b", "a,b", "t" * 129, None, 3):
        assert not is_tenant(bad)
        with pytest.raises(ValueError, match="bad tenant"):
            check_tenant(bad)
    check_weight(1e-9)
    check_weight(1_000_000)
    for bad in (0, -1, 1_000_001, float("nan")):
        with pytest.raises(ValueError, match="a weight must be more than 0"):
            check_weight(bad)
    check_half_life(1)
    for bad in (0.5, 2e9, float("nan")):
        with pytest.raises(ValueError, match="the half-life must be"):
            check_half_life(bad)


def test_gpuq_tenant_and_gpuq_status_print_each_tenant_while_fair_share_is_on():
    shown = [t.as_dict() for t in with_shares([_row("acme", 30.04, weight=3, running=2), _row("default", 10, pending=7)])]
    lines = render(shown, 3600)
    assert lines[0] == "usage half-life: 3600 s"
    assert [line.split() for line in lines[2:]] == [["acme", "3", "30.0", "75.0%", "75.0%", "2", "0"],
                                                    ["default", "1", "(default)", "10.0", "25.0%", "25.0%", "0", "7"]]
    body = {"live": {"pending": {}, "leased": {}, "scheduled": {}}, "totals": {"pending": 0, "leased": 0, "scheduled": 0},
            "oldest_pending_seconds": None, "history_estimate": 0, "tenants": shown}
    text = render_status(body)
    assert "fair share:" in text and text.splitlines()[-1].split()[:2] == ["default", "1"]
    assert "fair share" not in render_status({**body, "tenants": []})
