#!/usr/bin/env python3
"""Render the timeline of every schedule generator (p=4, m=8, F = B = W) into this folder, as PNG and text.

python packages/colo-pipeline/docs/make_pictures.py      # needs colo-pipeline[render] (matplotlib)
"""

from __future__ import annotations

from pathlib import Path

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

HERE = Path(__file__).resolve().parent


def main() -> None:
    unit = CostModel()
    half = CostModel(forward=0.5, backward_input=0.5, backward_weight=0.5)  # 2 chunks: half a stage each
    cases = {
        "gpipe": (gpipe(4, 8), unit),
        "1f1b": (one_f_one_b(4, 8), unit),
        "interleaved_1f1b": (interleaved_1f1b(4, 8, num_chunks=2), half),
        "zero_bubble_h1": (zero_bubble_h1(4, 8), unit),
    }
    texts = []
    for name, (schedule, cost) in cases.items():
        result = simulate(schedule, cost)
        render_png(result, HERE / f"timeline_{name}.png")
        texts.append(render_text(result))
    (HERE / "timelines.txt").write_text("\n\n".join(texts) + "\n")


if __name__ == "__main__":
    main()
