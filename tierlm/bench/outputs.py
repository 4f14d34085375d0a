"""Where a benchmark writes its JSON and PNG: checked before the run, named when writing fails.

Benchmarks run for minutes, so every output problem that can be seen up front is refused up
front (an empty name, a directory, an unwritable place, a format matplotlib cannot write, two
outputs that are one file, an output that is one of the benchmark's own input files), and a write
that still fails at the end says which flag and file it was.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

__all__ = ["check_outputs", "check_writable", "publish", "write_json"]


def check_writable(path: str, flag: str) -> None:
    """Fail now if `path` cannot be written: create its missing directories (as the writers
    would), then open it for appending if it exists, else make a temporary file where it (or
    the file a link at it names) will be."""
    if not path.strip():
        raise ValueError(f"{flag} is empty; give a file path")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory; give a file path")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"cannot write {flag} {path}: {parent} is not a directory; give a file "
                         "path in a writable directory")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if os.path.exists(path):
            open(path, "ab").close()  # os.access says yes to root even on /proc or read-only mounts
        else:  # a new file, or a link to one: try its directory (opening it would create the file)
            target_dir = os.path.dirname(os.path.realpath(path))
            os.makedirs(target_dir, exist_ok=True)
            tempfile.TemporaryFile(dir=target_dir).close()
    except OSError as e:
        raise ValueError(f"cannot write {flag} {path}: {e.strerror or e}; give a file path in a "
                         "writable directory") from None


def check_outputs(outputs: Mapping[str, str | None], inputs: Sequence[str] = (),
                  plot_flag: str = "--plot") -> dict[str, str | None]:
    """The outputs by flag (None: not asked for), with the plot's name as savefig will write it
    (no extension gets ".png"), after every check above. `inputs`: files the run reads, which an
    output must not overwrite."""
    from tierlm.bench.plots import check_plot_path, savefig_name

    out = dict(outputs)
    plot = out.get(plot_flag)
    if plot is not None and plot.strip():
        out[plot_flag] = savefig_name(plot)
    given = [(flag, path) for flag, path in out.items() if path is not None]
    read = {os.path.realpath(p): p for p in inputs}
    seen: dict[str, str] = {}
    for flag, path in given:
        if not path.strip():
            raise ValueError(f"{flag} is empty; give a file path")
        real = os.path.realpath(path)
        if real in read:
            raise ValueError(f"{flag} {path} is the input file {read[real]}; writing it would overwrite "
                             "the input: give another path")
        if real in seen:
            raise ValueError(f"{seen[real]} and {flag} are both {path}; give two different files")
        seen[real] = flag
    if plot is not None:
        check_plot_path(plot, plot_flag)
    for flag, path in given:
        check_writable(path, flag)
    return out


def write_json(path: str, obj: object, flag: str = "--json") -> None:
    """Write `obj` as indented JSON (creating directories); a failure names the flag and file."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=2))
    except OSError as e:
        raise ValueError(f"cannot write {flag} {path}: {e.strerror or e}") from None


def publish(doc: dict, json_path: str, report: Callable[[dict], str], plot_path: str | None,
            plot: Callable[[str, dict], object]) -> dict:
    """A run's end: its JSON written, its report printed, its plot drawn where asked."""
    write_json(json_path, doc)
    print(report(doc))
    if plot_path:
        plot(plot_path, doc)
    return doc
