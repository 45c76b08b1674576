"""Memory (RSS) and open fds over time as a hand-drawn SVG: no plotting dependency."""

from __future__ import annotations

from xml.sax.saxutils import escape

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _panel(out, x0, y0, w, h, series, t_max, label, fmt):
    values = [v for pts in series.values() for _, v, _ in pts]
    v_max = max(values) * 1.1 if values else 1.0
    v_max = v_max or 1.0
    out.append(f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#999"/>')
    for i in range(5):
        v = v_max * i / 4
        y = y0 + h - h * i / 4
        out.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + w}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11">{fmt(v)}</text>')
    for i in range(6):
        t = t_max * i / 5
        x = x0 + w * i / 5
        out.append(f'<text x="{x:.1f}" y="{y0 + h + 15}" text-anchor="middle" font-size="11">{t:.0f}</text>')
    out.append(f'<text x="{x0 - 48}" y="{y0 + h / 2}" font-size="12" '
               f'transform="rotate(-90 {x0 - 48} {y0 + h / 2})" text-anchor="middle">{escape(label)}</text>')
    for (name, pts), color in zip(series.items(), COLORS):
        xy = [(x0 + w * t / t_max, y0 + h - h * v / v_max, new) for t, v, new in pts]
        if len(xy) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in xy)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        for x, y, new in xy:
            r = 3.5 if new else 2
            fill = "white" if new else color
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r}" fill="{fill}" stroke="{color}"/>')


def memory_svg(samples: list[dict], title: str) -> str:
    """`samples`: [{"t": s, "procs": {name: {"rss": bytes, "fds": n, "new": bool}}}] in time order;
    "new" marks a process's first sample (a server restarted since the sample before)."""
    names: list[str] = []
    for s in samples:
        for name in s["procs"]:
            if name not in names:
                names.append(name)
    rss = {n: [(s["t"], s["procs"][n]["rss"] / 2**20, s["procs"][n].get("new", False))
               for s in samples if n in s["procs"]] for n in names}
    fds = {n: [(s["t"], s["procs"][n]["fds"], s["procs"][n].get("new", False))
               for s in samples if n in s["procs"]] for n in names}
    t_max = max((s["t"] for s in samples), default=1.0) or 1.0
    W, H = 860, 560
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif"><rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>']
    _panel(out, 80, 40, 600, 210, rss, t_max, "RSS (MiB)", lambda v: f"{v:.0f}")
    _panel(out, 80, 300, 600, 210, fds, t_max, "open fds", lambda v: f"{v:.0f}")
    out.append(f'<text x="380" y="{H - 15}" text-anchor="middle" font-size="12">seconds since start '
               '(a sample after each phase; hollow dot: first sample of a restarted server)</text>')
    for i, (name, color) in enumerate(zip(names, COLORS)):
        y = 60 + i * 20
        out.append(f'<line x1="700" y1="{y}" x2="725" y2="{y}" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="732" y="{y + 4}" font-size="12">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)
