"""Charts written to files (`plan`, `eval` and `bench` take --plot): matplotlib without a display,
and one rule for the file a chart goes to."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    return plt


def check_chart_path(path: str | Path | None) -> None:
    """Refuse a --plot file path that is a directory before any work is done (save_figure would
    only find out at the end)."""
    if path is not None and Path(path).is_dir():
        raise ValueError(f"--plot {path} is a directory: give the chart's file name (e.g. {Path(path) / 'chart.png'})")


def save_figure(fig: Any, path: str | Path, dpi: int = 120, **savefig_kwargs: Any) -> Path:
    """Write `fig` to `path` and return the file written: a path without a suffix gets `.png` (as
    matplotlib would add it, so the path reported is the file's), an existing directory is refused
    (a chart is one file), a missing parent directory is made. ValueError on what cannot be written."""
    out = Path(path)
    try:
        check_chart_path(out)
        if not out.suffix:
            out = out.with_name(out.name + ".png")
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=dpi, **savefig_kwargs)
    except OSError as exc:
        raise ValueError(f"cannot write the plot to {out}: {exc}") from None
    finally:
        pyplot().close(fig)
    return out
