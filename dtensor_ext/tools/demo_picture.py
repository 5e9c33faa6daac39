"""The demo's picture, as hand-written SVG (no plotting dependency): loss per step (sharded, one device, torch alone)
and collective bytes per rank per step (with the package, torch alone)."""

from __future__ import annotations

from pathlib import Path
from xml.sax.saxutils import escape

W, H, PAD = 420, 260, 44
COLORS = {"dtensor_ext": "#1f77b4", "one device": "#999999", "torch alone": "#d62728"}


def _panel(x0: int, title: str, series: dict[str, list[float]], y_label: str, bars: bool) -> list[str]:
    values = [v for vs in series.values() for v in vs] or [0.0]
    lo, hi = (0.0, max(values)) if bars else (min(values), max(values))
    hi = hi if hi > lo else lo + 1.0
    steps = max((len(vs) for vs in series.values()), default=0) or 1
    width, height = W - 2 * PAD, H - 2 * PAD

    def x(i: float) -> float:
        return x0 + PAD + width * (i + 0.5) / steps

    def y(v: float) -> float:
        return PAD + height * (1 - (v - lo) / (hi - lo))

    out = [f'<text x="{x0 + W / 2}" y="18" text-anchor="middle" font-weight="bold">{escape(title)}</text>',
           f'<rect x="{x0 + PAD}" y="{PAD}" width="{width}" height="{height}" fill="none" stroke="#444"/>',
           f'<text x="{x0 + 4}" y="{PAD - 6}">{escape(y_label)}</text>',
           f'<text x="{x0 + PAD - 4}" y="{PAD + 4}" text-anchor="end">{hi:.3g}</text>',
           f'<text x="{x0 + PAD - 4}" y="{PAD + height}" text-anchor="end">{lo:.3g}</text>',
           f'<text x="{x0 + W / 2}" y="{H - 10}" text-anchor="middle">step (1..{steps})</text>']
    for k, (name, vs) in enumerate(series.items()):
        color = COLORS[name]
        if bars:
            bar = width / steps / (len(series) + 1)
            out += [f'<rect x="{x(i) - width / steps / 2 + bar * (k + 0.5):.1f}" y="{y(v):.1f}" width="{bar:.1f}" '
                    f'height="{PAD + height - y(v):.1f}" fill="{color}"/>' for i, v in enumerate(vs)]
        elif vs:
            points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(vs))
            dash = ' stroke-dasharray="4 3"' if name == "one device" else ""
            out.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{x0 + W - PAD}" y="{PAD + 14 + 14 * k}" text-anchor="end" fill="{color}">'
                   f'{escape(name)}</text>')
    return out


def write_svg(report, path: Path) -> Path:
    pkg, alone = report.package, report.torch_alone
    losses = {"dtensor_ext": [s.loss for s in pkg.steps], "one device": [s.reference_loss for s in pkg.steps]}
    bytes_ = {"dtensor_ext": [sum(s.payload_bytes.values()) / 1024 for s in pkg.steps]}
    if alone is not None and alone.steps:
        losses["torch alone"] = [s.loss for s in alone.steps]
        bytes_["torch alone"] = [sum(s.payload_bytes.values()) / 1024 for s in alone.steps]
    body = _panel(0, "training loss", losses, "loss", bars=False)
    body += _panel(W, "collective payload per rank", bytes_, "KiB per step", bars=True)
    if alone is not None and alone.failure:
        body.append(f'<text x="{W + PAD}" y="{H + 14}" fill="{COLORS["torch alone"]}">torch alone fails at '
                    f'{escape(alone.failure[:90])}</text>')
    path = Path(path)
    path.write_text(f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{H + 24}" '
                    f'font-family="sans-serif" font-size="11">\n' + "\n".join(body) + "\n</svg>\n")
    return path
