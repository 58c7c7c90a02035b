"""actors.quiet_ray: the slowed timers are in the environment only for the block, and never replace a value
the operator set."""

import os

from actors.quiet_ray import QUIET_RAY, quiet_ray_environ


def test_sets_what_is_missing_and_restores(monkeypatch):
    for key in QUIET_RAY:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.1")  # the operator's choice wins
    with quiet_ray_environ() as added:
        assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"
        assert "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" not in added
        assert os.environ["RAY_raylet_report_resources_period_milliseconds"] == "1000"
        assert set(added) == set(QUIET_RAY) - {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S"}
    assert not any(k in os.environ for k in added)
    assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"


def test_restores_after_an_exception(monkeypatch):
    for key in QUIET_RAY:
        monkeypatch.delenv(key, raising=False)
    try:
        with quiet_ray_environ():
            raise RuntimeError("ray.init failed")
    except RuntimeError:
        pass
    assert not any(k in os.environ for k in QUIET_RAY)


def test_disabled_sets_nothing(monkeypatch):
    for key in QUIET_RAY:
        monkeypatch.delenv(key, raising=False)
    with quiet_ray_environ(enabled=False) as added:
        assert added == {} and not any(k in os.environ for k in QUIET_RAY)


def test_every_value_is_a_slower_period():
    assert all(float(v) >= 0.5 for v in QUIET_RAY.values())  # 1000 ms, or 0.5 s for Serve's loop
    assert all(k.startswith("RAY_") for k in QUIET_RAY)  # what Ray and Serve read
