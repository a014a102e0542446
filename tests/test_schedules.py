"""Learning-rate schedules match the paper's formulas."""

import math

import pytest

from transfer.schedules import discriminative_lrs, one_cycle_lr, slanted_triangular_lr


@pytest.mark.parametrize("total", [100, 1000, 37])
def test_stlr_at_start_cut_and_end_equals_the_formula(total):
    lr, cut_frac, ratio = 0.01, 0.1, 32
    cut = math.floor(total * cut_frac)
    assert slanted_triangular_lr(0, total, lr, cut_frac, ratio) == pytest.approx(lr / ratio)
    assert slanted_triangular_lr(cut, total, lr, cut_frac, ratio) == pytest.approx(lr)
    # the paper's p reaches 0 at t = cut / cut_frac, i.e. the LR is back to lr/ratio at the end
    end = round(cut / cut_frac)
    assert slanted_triangular_lr(end, end, lr, cut_frac, ratio) == pytest.approx(lr / ratio)
    t = cut + (end - cut) // 2
    p = 1 - (t - cut) / (cut * (1 / cut_frac - 1))
    assert slanted_triangular_lr(t, total, lr, cut_frac, ratio) == pytest.approx(lr * (1 + p * (ratio - 1)) / ratio)


def test_stlr_rises_then_falls():
    lrs = [slanted_triangular_lr(t, 200, 1.0) for t in range(200)]
    peak = lrs.index(max(lrs))
    assert peak == 20
    assert all(a < b for a, b in zip(lrs[:peak], lrs[1:peak + 1]))
    assert all(a > b for a, b in zip(lrs[peak:-1], lrs[peak + 1:]))


def test_discriminative_lrs_divide_by_2_6_per_group_below_the_top():
    lrs = discriminative_lrs(0.01, 5)
    assert lrs[-1] == pytest.approx(0.01)
    for k in range(5):
        assert lrs[4 - k] == pytest.approx(0.01 / 2.6 ** k)


def test_one_cycle_peaks_at_lr_max_and_ends_near_zero():
    total = 100
    lrs = [one_cycle_lr(t, total, 1.0) for t in range(total + 1)]
    assert lrs[0] == pytest.approx(1 / 25)
    assert max(lrs) == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(1e-5)
