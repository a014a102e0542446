"""Calibration and the ulmfit+tfidf mix: temperature scaling fitted on held-out labels."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.evaluate import calibrated_average, fit_temperature, softmax


def _sample(rng: np.random.Generator, n: int, k: int, true_t: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Labels drawn from softmax(logits); a model reports softmax(logits / true_t) (mis-calibrated by true_t)."""
    logits = rng.normal(0, 2.0, (n, k))
    y = np.array([rng.choice(k, p=p) for p in softmax(logits)])
    return softmax(logits / true_t), softmax(logits), y


@pytest.mark.parametrize("true_t", [0.25, 4.0])
def test_fit_temperature_undoes_a_known_miscalibration(true_t):
    reported, _, y = _sample(np.random.default_rng(0), 4000, 4, true_t)
    t = fit_temperature(reported, y)
    # reported = softmax(z / true_t), so scaling its log by 1/T recovers softmax(z) at T = 1/true_t
    assert t == pytest.approx(1 / true_t, rel=0.15)


def test_fit_temperature_never_worsens_held_out_nll():
    reported, _, y = _sample(np.random.default_rng(1), 2000, 3, 0.2)  # overconfident
    nll = lambda p: -np.log(p[np.arange(len(y)), y]).mean()  # noqa: E731
    t = fit_temperature(reported, y)
    assert nll(calibrated_average([reported], [t])) < nll(reported) - 0.1


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(2, 6), st.floats(0.05, 20), st.integers(0, 10_000))
def test_calibrated_average_is_a_distribution(members, k, t, seed):
    rng = np.random.default_rng(seed)
    probas = [softmax(rng.normal(0, 5, (7, k))) for _ in range(members)]
    out = calibrated_average(probas, [t] * members)
    assert out.shape == (7, k)
    assert np.allclose(out.sum(axis=1), 1.0) and (out >= 0).all()


def test_calibration_keeps_an_overconfident_member_from_dominating():
    rng = np.random.default_rng(2)
    n, k = 3000, 4
    y = rng.integers(0, k, n)
    good = softmax(np.eye(k)[y] * 1.5 + rng.normal(0, 1, (n, k)))  # right ~75%, modest confidence
    bad_logits = rng.normal(0, 1, (n, k)) * 20  # near-random and very confident
    bad = softmax(bad_logits)
    acc = lambda p: (p.argmax(1) == y).mean()  # noqa: E731
    naive = np.mean([good, bad], axis=0)
    temps = [fit_temperature(good, y), fit_temperature(bad, y)]
    calibrated = calibrated_average([good, bad], temps)
    assert acc(calibrated) > acc(naive) + 0.1
    assert acc(calibrated) >= acc(good) - 0.02


def test_select_members_never_averages_in_a_member_at_chance():
    from transfer.stages.self_training import select_members

    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 400)
    good = np.eye(4)[np.where(rng.random(400) < 0.85, y, rng.integers(0, 4, 400))] * 0.7 + 0.075
    also_good = np.eye(4)[np.where(rng.random(400) < 0.85, y, rng.integers(0, 4, 400))] * 0.7 + 0.075
    chance = np.full((400, 4), 0.01)
    chance[:, 2] = 0.97  # a collapsed classifier: one class for every text, very confidently
    members, acc = select_members({"fwd": good, "fwd-1": also_good, "bwd": chance}, y)
    assert "bwd" not in members and members[0] in ("fwd", "fwd-1")
    assert acc >= max((good.argmax(1) == y).mean(), (also_good.argmax(1) == y).mean())
    assert select_members({"bwd": chance}, y)[0] == ["bwd"]  # one member: kept, whatever it scores


def test_the_mix_choice_breaks_an_accuracy_tie_on_validation_nll():
    from transfer.stages.evaluate import choose_on_validation

    y = np.array([0, 1, 2, 0, 1, 2, 0, 1])
    right = softmax(np.eye(3)[y] * 2.0)
    near_miss, sure_miss = right.copy(), right.copy()  # both wrong on row 0 only: the same accuracy
    near_miss[0] = [0.35, 0.55, 0.10]  # the true class a close second
    sure_miss[0] = [0.001, 0.998, 0.001]  # no room for the true class, whatever the temperature
    chosen, scores = choose_on_validation({"average": sure_miss, "tfidf": near_miss}, y)
    assert chosen == "tfidf" and scores["average"]["accuracy"] == scores["tfidf"]["accuracy"] == 7 / 8
    # accuracy still comes first: one more right row beats a lower NLL
    two_near_misses = near_miss.copy()
    two_near_misses[1] = [0.10, 0.35, 0.55]
    chosen, scores = choose_on_validation({"tfidf": two_near_misses, "average": sure_miss}, y)
    assert chosen == "average" and scores["average"]["nll"] > scores["tfidf"]["nll"]
    # an exact tie on both keeps the first listed (the average)
    assert choose_on_validation({"average": near_miss, "ulmfit": near_miss.copy()}, y)[0] == "average"
