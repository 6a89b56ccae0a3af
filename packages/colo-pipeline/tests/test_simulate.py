"""The simulator reproduces the papers' closed forms; the renderer draws its timelines."""

from __future__ import annotations

import pytest

from colo.pipeline import (
    CostModel,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    render_png,
    render_text,
    simulate,
    zero_bubble_h1,
)

SIZES = [(p, m) for p in (2, 3, 4, 8) for m in (p, p + 1, 2 * p, 3 * p + 1)]


@pytest.mark.parametrize("p, m", SIZES)
def test_one_f_one_b_bubble_is_the_closed_form(p, m):
    result = simulate(one_f_one_b(p, m))  # F = B = W = 1, free p2p: equal stage costs
    assert result.bubble_ratio == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert result.makespan == pytest.approx(3 * (m + p - 1))
    assert simulate(gpipe(p, m)).bubble_ratio == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p, k", [(p, k) for p in (2, 3, 4, 8) for k in (1, 2, 3)])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_interleaved_bubble_is_the_closed_form(p, k, v):
    m = k * p
    # each chunk holds 1/v of a stage's layers: equal stage costs split evenly over the chunks
    cost = CostModel(forward=1 / v, backward_input=1 / v, backward_weight=1 / v)
    result = simulate(interleaved_1f1b(p, m, num_chunks=v), cost)
    assert result.bubble_ratio == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9)


@pytest.mark.parametrize("p, m", SIZES)
def test_zero_bubble_h1_idles_a_third_of_1f1b_at_its_peak_memory(p, m):
    zb, ofob = simulate(zero_bubble_h1(p, m)), simulate(one_f_one_b(p, m))  # F = B = W
    # idle time per rank: (p - 1) against 3 (p - 1). The *ratio* idle/makespan is a bit more than a third of
    # 1F1B's, because ZB-H1's makespan is shorter too: (p-1)/(3m+p-1) against (p-1)/(m+p-1).
    assert zb.idle == pytest.approx([p - 1] * p)
    assert max(zb.idle) == pytest.approx(max(ofob.idle) / 3)
    assert zb.bubble_ratio == pytest.approx((p - 1) / (3 * m + p - 1))
    assert zb.bubble_ratio < ofob.bubble_ratio
    assert max(zb.peak_live_activations) == max(ofob.peak_live_activations) == p


def test_p2p_cost_and_unequal_stages_lengthen_the_step():
    base = simulate(one_f_one_b(4, 8)).makespan
    assert simulate(one_f_one_b(4, 8), CostModel(p2p=0.1)).makespan > base
    slow_last = CostModel(stage_scale=(1, 1, 1, 2))
    assert simulate(one_f_one_b(4, 8), slow_last).makespan == pytest.approx(3 * 2 * 8 + 3 * 3)


def test_cost_model_rejects_negative_times():
    with pytest.raises(ValueError, match="CostModel.forward=-1"):
        CostModel(forward=-1)


def test_text_timeline_shows_each_action_and_the_bubble():
    text = render_text(simulate(one_f_one_b(2, 3)))
    lines = text.splitlines()
    assert lines[0].startswith("1f1b: p=2 m=3 v=1  makespan 12  bubble 25.0%")
    assert lines[1] == "rank 0 |F0 F1 .  .  BW0   F2 BW1   .  BW2"
    assert lines[2] == "rank 1 |.  F0 BW0   F1 BW1   F2 BW2   .  ."


def test_png_timeline(tmp_path):
    pytest.importorskip("matplotlib", reason="the PNG renderer needs the 'render' extra (matplotlib)")
    path = render_png(simulate(zero_bubble_h1(4, 8)), tmp_path / "zb.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
