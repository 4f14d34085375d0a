"""Small matplotlib helpers shared by the `tierlm bench` commands.

Benchmarks write a PNG next to their JSON; these helpers keep those figures uniform (same size,
grid, legend placement) and keep matplotlib details out of the benchmark code. The Agg backend is
forced so plotting works on headless machines and never opens a window.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend must be chosen first)

Series = Mapping[str, tuple[Sequence[float], Sequence[float]]]

__all__ = ["Series", "Styles", "check_plot_path", "savefig_name", "line_plot", "panels_plot", "stacked_plot", "cdf_plot", "bar_plot", "grouped_bars"]


def savefig_name(path: str) -> str:
    """The file savefig writes for `path`: a name without an extension gets the default format's."""
    if os.path.splitext(path)[1].lstrip("."):
        return path
    return path.rstrip(".") + "." + str(matplotlib.rcParams["savefig.format"])


def check_plot_path(path: str | None, flag: str = "--plot") -> str | None:
    """The file a figure asked for as `path` lands in (`savefig_name`), checked before a
    benchmark runs, not after: an empty name, a directory and a format matplotlib cannot write
    are refused."""
    if path is None:
        return None
    if not path.strip():
        raise ValueError(f"{flag} is empty; give a file path such as results.png")
    if os.path.isdir(path):  # savefig would write `path`.png beside it: not what was meant
        raise ValueError(f"{flag} {path} is a directory; give a file path such as {os.path.join(path, 'results.png')}")
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    fig = plt.figure()
    formats = fig.canvas.get_supported_filetypes()
    plt.close(fig)
    if ext and ext not in formats:
        raise ValueError(f"{flag} {path}: matplotlib cannot write a figure as .{ext}; end the name with one of "
                         + ", ".join("." + f for f in sorted(formats)))
    return savefig_name(path)


def _save(fig: "plt.Figure", path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise ValueError(f"cannot write the plot {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path


Styles = Mapping[str, Mapping[str, object]]


def _label_x_values(ax: "plt.Axes", values: Sequence[float]) -> None:
    """On a log x axis, label the measured x values themselves (up to 12 of them): within one
    decade matplotlib labels minor ticks too ("3×10²4×10²" ran together for 50, 200, 800)."""
    xs = sorted({float(x) for x in values if x > 0})
    if 0 < len(xs) <= 12:
        from matplotlib.ticker import NullFormatter
        ax.set_xticks(xs, [f"{x:,.0f}" if x == int(x) else f"{x:g}" for x in xs])
        ax.xaxis.set_minor_formatter(NullFormatter())


def _draw_lines(ax: "plt.Axes", series: Series, xlabel: str, ylabel: str, logx: bool,
                markers: bool, styles: Styles | None = None) -> None:
    for label, (xs, ys) in series.items():
        kw: dict[str, object] = {"marker": "o" if markers else None, "markersize": 4}
        kw.update((styles or {}).get(label, {}))
        ax.plot(list(xs), list(ys), label=label, **kw)
    if logx:
        ax.set_xscale("log")
        _label_x_values(ax, [x for xs, _ in series.values() for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize="small")


def line_plot(path: str, series: Series, title: str, xlabel: str, ylabel: str,
              logx: bool = False, markers: bool = True, styles: Styles | None = None, logy: bool = False) -> str:
    """One panel, one line per series label: `series[label] = (xs, ys)`. Returns `path`.

    `styles[label]` holds extra matplotlib line kwargs, e.g. {"linestyle": "--"} for a bound.
    """
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _draw_lines(ax, series, xlabel, ylabel, logx, markers, styles)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    return _save(fig, path)


def panels_plot(path: str, panels: Mapping[str, Series], title: str, xlabel: str, ylabel: str,
                logx: bool = False, markers: bool = True, sharey: bool = False,
                styles: Styles | None = None) -> str:
    """Side-by-side panels (e.g. one per trace), each drawn like `line_plot`."""
    n = max(len(panels), 1)
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4.5), sharey=sharey, squeeze=False)
    for ax, (panel_title, series) in zip(axes[0], panels.items()):
        _draw_lines(ax, series, xlabel, ylabel, logx, markers, styles)
        ax.set_title(panel_title)
    fig.suptitle(title)
    return _save(fig, path)


def cdf_plot(path: str, samples: Mapping[str, Sequence[float]], title: str, xlabel: str,
             logx: bool = False) -> str:
    """Empirical CDF per label (latencies, lengths...). Empty sample lists are skipped."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in samples.items():
        xs = sorted(values)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=label)
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction ≤ x")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    if samples:
        ax.legend(fontsize="small")
    return _save(fig, path)


def bar_plot(path: str, values: Mapping[str, float], title: str, ylabel: str, logy: bool = False) -> str:
    """One bar per label (e.g. throughput per configuration)."""
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(values) + 2), 4.5))
    labels = list(values)
    ax.bar(range(len(labels)), [values[k] for k in labels])
    if logy:
        ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(title)
    return _save(fig, path)


def grouped_bars(path: str, groups: Mapping[str, Mapping[str, float]], title: str, ylabel: str) -> str:
    """Bars side by side per group (e.g. each engine's throughput per workload); a series missing
    from a group leaves its place empty."""
    series = list(dict.fromkeys(k for g in groups.values() for k in g))
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(groups) + 2), 4.5))
    width = 0.8 / max(1, len(series))
    for i, name in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j, g in enumerate(groups.values()) if name in g]
        ax.bar(xs, [g[name] for g in groups.values() if name in g], width, label=name)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(title)
    return _save(fig, path)


def stacked_plot(path: str, panels: Mapping[str, tuple[str, Series]], title: str, xlabel: str,
                 logx: bool = False, markers: bool = False) -> str:
    """Panels stacked vertically on a shared x axis, each with its own y label:
    `panels[panel_title] = (ylabel, series)` — e.g. throughput and latency over time."""
    n = max(len(panels), 1)
    fig, axes = plt.subplots(n, 1, figsize=(8, 3.2 * n), sharex=True, squeeze=False)
    for ax, (panel_title, (ylabel, series)) in zip(axes[:, 0], panels.items()):
        _draw_lines(ax, series, "", ylabel, logx, markers)
        ax.set_title(panel_title, fontsize="medium")
    axes[-1, 0].set_xlabel(xlabel)
    fig.suptitle(title)
    return _save(fig, path)

