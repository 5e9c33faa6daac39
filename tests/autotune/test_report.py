"""Table, text plot and SVG from a known result (no processes needed)."""

from __future__ import annotations

import xml.dom.minidom

from dtensor_ext.autotune import AlphaBeta, CalibrationEntry, Choice, Step, TuneResult
from dtensor_ext.autotune.report import ascii_plots, format_report, svg_plots

STEPS = [Step("all_to_all", (0,), 1024), Step("all_to_all", (0,), 65536)]
RESULT = TuneResult(
    key="gloo/cpu/mesh=2x2/float32",
    cache_hit=False,
    entry=CalibrationEntry(
        {0: AlphaBeta(1e-4, 1e-9)},
        {STEPS[0].name: Choice("all_to_all_single", 1e-4, False, None),
         STEPS[1].name: Choice("all_to_all_single", 2e-3, True, "send_recv on rank 2: timed out")},
    ),
    steps=STEPS,
    measurements={STEPS[0].name: {"all_to_all_single": 1e-4, "send_recv": 3e-4},
                  STEPS[1].name: {"all_to_all_single": 2e-3}},
    held_out={0: 1.7},
    failure="send_recv on rank 2: timed out",
)


def test_table_shows_choices_fallbacks_and_fit():
    text = format_report(RESULT)
    assert "FAILED, defaults used from then on: send_recv on rank 2: timed out" in text
    assert "all_to_all/mesh_dims=0/bytes=1024" in text and "0.100 ms" in text
    assert "fallback: send_recv on rank 2: timed out" in text
    assert "100.0 us" in text and "1.000 GB/s" in text and "1.70x" in text


def test_plots_place_every_measurement():
    text = ascii_plots(RESULT)
    assert "all_to_all on mesh dims 0" in text and "o all_to_all_single   x send_recv" in text
    plot_rows = [line.split("|", 1)[1] for line in text.splitlines() if "|" in line]
    assert sum(row.count("o") for row in plot_rows) == 2 and sum(row.count("x") for row in plot_rows) == 1
    svg = xml.dom.minidom.parseString(svg_plots(RESULT))
    assert len(svg.getElementsByTagName("polyline")) == 2
