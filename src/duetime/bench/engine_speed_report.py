"""`duetime bench engine`'s report: speed-up ratios, the table and the plot.

Kept apart from :mod:`duetime.bench.engine_speed` (which times the cells) so
the figures' presentation can change without touching the measurement.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["BEFORE_VARIANTS", "plot", "ratios", "table"]

#: Engine variants that keep an earlier kernel: every other variant gets a ratio to them.
BEFORE_VARIANTS = ("fp32-mkl", "q8-unfused", "q8-int8rank", "q8-pyloop")


def ratios(figs: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """``speedup_vs_<peer>``: engine ÷ peer tok/s per cell (``prefill_128``, ``decode_b16``)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    peers = [k for k, f in figs.items() if f["kind"] != "engine"]
    bases = [b for b in BEFORE_VARIANTS if b in figs]  # earlier kernels, when measured too
    for name, f in figs.items():
        if f["kind"] != "engine":
            continue
        for peer in [p for p in (*peers, *bases) if p != name]:
            cells = {}
            for kind, key, unit in (
                ("prefill", "tokens", "prefill_tok_s"),
                ("decode", "batch", "decode_tok_s"),
            ):
                theirs = {c[key]: c[unit] for c in figs[peer][kind]}
                for c in f[kind]:
                    if c[key] in theirs:
                        tag = f"{kind}_{c[key]}" if kind == "prefill" else f"decode_b{c[key]}"
                        cells[tag] = c[unit] / theirs[c[key]]
            key = "speedup_vs_" + peer.replace("-", "_").replace(".", "_")
            out.setdefault(name, {})[key] = cells
    return out


def table(fig: dict[str, Any]) -> Any:
    """A rich table: one row per variant, prefill and decode columns with roofline."""
    from rich.table import Table

    s = fig["settings"]
    t = Table(
        title=(
            f"{fig['model']}: {fig['machine']['torch_threads']} threads, "
            f"copy bandwidth {fig['memory_bandwidth_gb_s']:.1f} GB/s, decode after "
            f"{s['context_tokens']} tokens (tok/s, roofline in brackets)"
        )
    )
    t.add_column("variant")
    for n in s["prefill_tokens"]:
        t.add_column(f"prefill {n}", justify="right")
    for b in s["batch_sizes"]:
        t.add_column(f"decode b{b}", justify="right")
    t.add_column("own RSS MiB", justify="right")
    for name, f in fig["variants"].items():
        pre = {c["tokens"]: c for c in f["prefill"]}
        dec = {c["batch"]: c for c in f["decode"]}
        row = [name]
        row += [f"{pre[n]['prefill_tok_s']:.0f}" if n in pre else "-" for n in s["prefill_tokens"]]
        row += [
            f"{dec[b]['decode_tok_s']:.1f} ({dec[b]['roofline_tok_s']:.0f})" if b in dec else "-"
            for b in s["batch_sizes"]
        ]
        row.append(f"{f['own_rss_mib']:.0f}")
        t.add_row(*row)
    return t


def plot(fig: dict[str, Any], path: str | Path) -> Path:
    """Prefill and decode tok/s per variant (log scale), decode rooflines dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from duetime.metrics.atomic import save_png

    f, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, v in fig["variants"].items():
        if v["prefill"]:
            a1.plot(
                [c["tokens"] for c in v["prefill"]],
                [c["prefill_tok_s"] for c in v["prefill"]],
                "o-",
                label=name,
            )
        if v["decode"]:
            (line,) = a2.plot(
                [c["batch"] for c in v["decode"]],
                [c["decode_tok_s"] for c in v["decode"]],
                "o-",
                label=name,
            )
            if v["kind"] == "engine":
                a2.plot(
                    [c["batch"] for c in v["decode"]],
                    [c["roofline_tok_s"] for c in v["decode"]],
                    "--",
                    color=line.get_color(),
                    alpha=0.5,
                )
    for ax, title, xl in (
        (a1, "prefill (one prompt)", "prompt tokens"),
        (a2, "decode (dashed: memory roofline)", "batch"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel(xl)
        ax.set_ylabel("tok/s")
        ax.grid(alpha=0.3, which="both")
    a2.legend(fontsize=8)
    f.suptitle(
        f"{fig['model']} on {fig['machine']['cpu']}, {fig['machine']['torch_threads']} threads"
    )
    f.tight_layout()
    return save_png(f, path)
