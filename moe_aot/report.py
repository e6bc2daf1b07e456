"""A picture of a tuning session: every trial's time against its configuration, and the best per
bucket against the roofline floor, as a PNG and a small HTML page around it. matplotlib is an
optional extra (`pip install 'moe-aot[report]'`)."""
from __future__ import annotations

import base64
import html
from pathlib import Path

from .database import Database
from .picks import confirmation, format_summary, roofline_floor_us, summary
from .spec import LayerSpec
from .variants import DecodeVariant, parse_variant


def _config(name: str) -> str:
    v = parse_variant(name)
    if isinstance(v, DecodeVariant):
        return f"one launch: {v.producer} producer, {v.sync} sync, {v.stages} stages, up to {v.max_tokens} tokens"
    return f"m{v.tile_m} glu {v.glu.tag} / down {v.down.tag}"


def _tile_m(name: str) -> int:
    """The colour of a configuration: its routing tile height (the decode kernel has none: 0)."""
    v = parse_variant(name)
    return 0 if isinstance(v, DecodeVariant) else v.tile_m


def _table(tokens: int, recs) -> str:
    names = sorted({r.variant for r in recs})
    rows = "".join(f"<tr><td>{names.index(r.variant)}<td>{html.escape(_config(r.variant))}<td>{r.status}"
                   f"{' (confirmation round)' if confirmation(r) else ''}"
                   f"<td>{'' if r.median_us is None else f'{r.median_us:.1f}'}<td>{html.escape(r.variant)}"
                   for r in sorted(recs, key=lambda r: names.index(r.variant)))
    return (f"<h3>tokens={tokens}</h3><table border=1 cellspacing=0><tr><th>index<th>configuration"
            f"<th>status<th>median µs<th>variant{rows}</table>")


def render(db: Database, spec: LayerSpec, gpu: str, buckets, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary(db, spec, gpu, buckets)
    recs = {t: db.records(spec.workload_key, spec.target, gpu, t) for t in buckets}
    shown = [t for t in buckets if recs[t]]
    fig, axes = plt.subplots(1 + len(shown), 1, figsize=(10, 3.6 + 2.8 * len(shown)), squeeze=False,
                             gridspec_kw={"height_ratios": [1.3] + [1] * len(shown)})
    ax = axes[0][0]
    ok = [r for r in rows if r["best_us"]]
    ax.loglog([r["tokens"] for r in ok], [r["best_us"] for r in ok], "o-", label="best tuned")
    xs = sorted(buckets)
    ax.loglog(xs, [roofline_floor_us(spec, t) for t in xs], "k--", label="roofline floor")
    ax.set_xlabel("tokens")
    ax.set_ylabel("µs")
    ax.set_title(f"{spec.label()} on {gpu}: best per bucket vs roofline floor")
    ax.legend(fontsize=8)
    for ax, t in zip((a[0] for a in axes[1:]), shown):
        # Configurations sorted by name sit next to those sharing tile_m and GEMM1 tiles; the
        # HTML page lists the names.
        names = sorted({r.variant for r in recs[t]})
        pos = {n: i for i, n in enumerate(names)}
        good = [r for r in recs[t] if r.status == "ok"]
        bad = [r for r in recs[t] if r.status != "ok"]
        floor = roofline_floor_us(spec, t)
        top = max([r.median_us for r in good] + [floor]) * 1.5
        sc = ax.scatter([pos[r.variant] for r in good], [r.median_us for r in good], s=16,
                        c=[_tile_m(r.variant) for r in good], cmap="viridis", vmin=64, vmax=128)
        ax.scatter([pos[r.variant] for r in bad], [top] * len(bad), marker="x", c="red", s=16,
                   label="failed: compile, resources or wrong result")
        ax.axhline(floor, color="k", ls="--", lw=0.8, label="roofline floor")
        ax.set_yscale("log")
        ax.set_title(f"tokens={t}: {len(recs[t])} measured configurations", fontsize=10)
        ax.set_ylabel("median µs")
        ax.set_xlabel("configuration index (sorted by variant name)")
        ax.legend(fontsize=7, loc="upper left")
        fig.colorbar(sc, ax=ax, label="tile_m", ticks=[64, 128])
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{spec.label()}_{gpu.replace(' ', '_')}"
    png = out_dir / f"{stem}.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    page = out_dir / f"{stem}.html"
    img = base64.b64encode(png.read_bytes()).decode()
    page.write_text(f"<!doctype html><meta charset=utf-8><title>{html.escape(stem)}</title>"
                    f"<pre>{html.escape(format_summary(spec, gpu, rows))}</pre>"
                    f"<img src='data:image/png;base64,{img}'>" + "".join(_table(t, recs[t]) for t in shown))
    return [png, page]
