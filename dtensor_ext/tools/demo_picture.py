"""The demo's picture, as hand-written SVG (no plotting dependency): loss per step (sharded, one device, torch alone)
and the bytes the busiest rank receives per step (with the package, torch alone; with ``--no-package`` the torch-alone
job alone, labelled so). Legends sit above each panel and
the footer is wrapped to the canvas, so no label covers the data or runs off the picture."""

from __future__ import annotations

from pathlib import Path
from xml.sax.saxutils import escape

W, H, PAD, TOP = 420, 280, 44, 64  # panel width and height, side margins, top margin (title and legend)
CHAR_W = 6.2  # width of an 11 px sans-serif character, generously
COLORS = {"dtensor_ext": "#1f77b4", "one device": "#999999", "torch alone": "#d62728"}


def _panel(x0: int, title: str, series: dict[str, list[float]], y_label: str, bars: bool) -> list[str]:
    values = [v for vs in series.values() for v in vs] or [0.0]
    lo, hi = (0.0, max(values)) if bars else (min(values), max(values))
    hi = hi if hi > lo else lo + 1.0
    steps = max((len(vs) for vs in series.values()), default=0) or 1
    width, height = W - 2 * PAD, H - TOP - PAD

    def x(i: float) -> float:
        return x0 + PAD + width * (i + 0.5) / steps

    def y(v: float) -> float:
        return TOP + height * (1 - (v - lo) / (hi - lo))

    out = [f'<text x="{x0 + W / 2}" y="18" text-anchor="middle" font-weight="bold">{escape(title)}</text>',
           f'<rect x="{x0 + PAD}" y="{TOP}" width="{width}" height="{height}" fill="none" stroke="#444"/>',
           f'<text x="{x0 + PAD}" y="{TOP - 6}">{escape(y_label)}</text>',
           f'<text x="{x0 + PAD - 4}" y="{TOP + 4}" text-anchor="end">{hi:.3g}</text>',
           f'<text x="{x0 + PAD - 4}" y="{TOP + height}" text-anchor="end">{lo:.3g}</text>',
           f'<text x="{x0 + W / 2}" y="{H - 14}" text-anchor="middle">step (1..{steps})</text>']
    legend_x = x0 + PAD  # one row above the plot, left to right
    for k, (name, vs) in enumerate(series.items()):
        color = COLORS[name]
        if bars:
            bar = width / steps / (len(series) + 1)
            out += [f'<rect x="{x(i) - width / steps / 2 + bar * (k + 0.5):.1f}" y="{y(v):.1f}" width="{bar:.1f}" '
                    f'height="{TOP + height - y(v):.1f}" fill="{color}"/>' for i, v in enumerate(vs)]
        elif vs:
            points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(vs))
            dash = ' stroke-dasharray="4 3"' if name == "one device" else ""
            out.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        out.append(f'<rect x="{legend_x}" y="31" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{legend_x + 14}" y="40" fill="{color}">{escape(name)}</text>')
        legend_x += 14 + CHAR_W * len(name) + 16
    return out


def _wrapped(text: str, width: float) -> list[str]:
    """`text` in lines of at most `width` pixels, broken at spaces."""
    most = int(width // CHAR_W)
    lines, line = [], ""
    for word in text.split():
        while len(word) > most:  # a word longer than a line is cut
            if line:
                lines, line = lines + [line], ""
            lines.append(word[:most])
            word = word[most:]
        if line and len(line) + 1 + len(word) > most:
            lines, line = lines + [line], word
        else:
            line = f"{line} {word}" if line else word
    return lines + ([line] if line else [])


def write_svg(report, path: Path) -> Path:
    """The picture of ``report``'s jobs, each labelled by what ran: "dtensor_ext", or "torch alone" for the torch-alone
    job (the only one with ``--no-package``); a job that failed is named in the footer with its failure."""
    jobs = {"dtensor_ext" if report.with_package else "torch alone": report.package}
    if report.torch_alone is not None:
        jobs["torch alone"] = report.torch_alone
    losses, bytes_ = {}, {}
    for k, (name, job) in enumerate(jobs.items()):
        if job.steps:
            losses[name] = [s.loss for s in job.steps]
            if k == 0:  # the reference the first job trained against, step by step
                losses["one device"] = [s.reference_loss for s in job.steps]
            bytes_[name] = [sum(s.received_bytes.values()) / 1024 for s in job.steps]
    body = _panel(0, "training loss", losses, "loss", bars=False)
    body += _panel(W, "collective bytes received by the busiest rank", bytes_, "KiB per step", bars=True)
    footer = [(name, line) for name, job in jobs.items() if job.failure
              for line in _wrapped(f"{name} fails at {job.failure}", 2 * W - 2 * PAD)]
    body += [f'<text x="{PAD}" y="{H + 14 * i}" fill="{COLORS[name]}">{escape(line)}</text>'
             for i, (name, line) in enumerate(footer)]
    path = Path(path)
    path.write_text(f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{H + 14 * len(footer) + 6}" '
                    f'font-family="sans-serif" font-size="11">\n<rect width="100%" height="100%" fill="white"/>\n'
                    + "\n".join(body) + "\n</svg>\n")
    return path
