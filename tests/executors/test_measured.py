"""The machine-dependent choices measured once at start-up: how they are timed and kept."""

from __future__ import annotations

import json

import pytest

from kvflow.executors import measured


def _scripted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each timed function returns its own duration; the order of the calls is recorded."""
    calls: list[str] = []

    def seconds(fn):
        name, duration = fn()
        calls.append(name)
        return duration

    monkeypatch.setattr(measured, "_seconds", seconds)
    return calls


def test_a_burst_in_one_round_does_not_move_the_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _scripted(monkeypatch)
    slow_times = iter([None, 3.0, 3.0, 30.0, 3.0, 3.0])  # None: the warm-up call; 30: a co-tenant's burst
    fast_times = iter([None, 2.0, 2.0, 2.0, 2.0, 2.0])
    ratio = measured.median_time_ratio(lambda: ("slow", next(slow_times)), lambda: ("fast", next(fast_times)),
                                       rounds=5)
    assert ratio == pytest.approx(1.5)
    # the warm-up is not timed; then the order swaps every round
    assert calls == ["slow", "fast", "fast", "slow", "slow", "fast", "fast", "slow", "slow", "fast"]


def test_the_real_measure_times_both_kernels() -> None:
    """Shape only: a positive, finite ratio from the packed kernel and oneDNN on this CPU."""
    if not measured.packed_matmul.available():  # no compiler: no packed kernel to time, and bf16_copies_pay
        # answers no without measuring (test_no_copies_without_native_bfloat16's path); CI has g++
        pytest.skip("the native kernels did not build here")
    ratio = measured.measure_bf16_speedup()
    assert 0 < ratio < float("inf")


def test_a_choice_is_measured_once_and_kept(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    path = tmp_path / "measured.json"
    monkeypatch.setattr(measured, "_cache_file", lambda: path)
    runs = []

    def measure() -> float:
        runs.append(1)
        return 1.25

    assert measured._remembered("thing", measure) == 1.25
    assert measured._remembered("thing", measure) == 1.25
    assert len(runs) == 1
    kept = json.loads(path.read_text())
    assert list(kept.values()) == [1.25]
    assert next(iter(kept)).startswith("thing|")  # keyed by the CPU, tier, torch and thread count too


@pytest.mark.parametrize("speedup, pays", [(1.4, False), (2.5, True)])
def test_copies_pay_only_above_the_threshold(monkeypatch: pytest.MonkeyPatch, tmp_path, speedup, pays) -> None:
    monkeypatch.setattr(measured, "_cache_file", lambda: tmp_path / "measured.json")
    monkeypatch.setattr(measured.cpu_features, "has_native_bf16_matmul", lambda: True)
    monkeypatch.setattr(measured.cpu_features, "isa_tier", lambda: "avx512")
    monkeypatch.setattr(measured.packed_matmul, "available", lambda: True)
    monkeypatch.setattr(measured, "measure_bf16_speedup", lambda: speedup)
    assert measured.bf16_copies_pay() is pays


def test_no_copies_without_native_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(measured.cpu_features, "has_native_bf16_matmul", lambda: False)
    monkeypatch.setattr(measured, "measure_bf16_speedup", lambda: pytest.fail("measured where it cannot pay"))
    assert measured.bf16_copies_pay() is False
