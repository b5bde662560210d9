"""The reliability diagram: predicted probability against observed frequency, one curve per class.

matplotlib is optional (`pip install matplotlib`): without it `reliability_diagram` raises a
`UserError` saying so, and `hpref eval` reports the missing plot on one line instead of failing the
whole evaluation. The Agg backend is forced, so no display is ever needed (clusters, CI).
"""

from __future__ import annotations

import io
from pathlib import Path

from hpref.errors import UserError
from hpref.prediction.metrics import EvalMetrics
from hpref.runfolder.files import write_bytes_atomic

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
COLOURS = {"a": "tab:blue", "b": "tab:orange", "tie": "tab:green"}


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def reliability_diagram(metrics: EvalMetrics, path: str | Path, title: str = "reliability") -> Path:
    """Write a PNG: per class, mean predicted vs mean observed per bin (marker area ~ bin count),
    the diagonal of perfect calibration, the class's ECE in the legend; a histogram of predictions
    below shows where the mass is (calibration in an empty region matters little)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError(
            "the reliability diagram needs matplotlib, which is not installed (pip install matplotlib)"
        ) from None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(5.5, 6.5), gridspec_kw={"height_ratios": [3, 1]}, sharex=True
    )
    try:
        top.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect")
        total = max(1, metrics.n)
        for cal in metrics.calibration:
            centres = [(lo + hi) / 2 for lo, hi in zip(cal.bin_edges[:-1], cal.bin_edges[1:], strict=True)]
            used = [i for i, k in enumerate(cal.counts) if k > 0]
            xs = [cal.mean_predicted[i] for i in used]
            ys = [cal.mean_observed[i] for i in used]
            sizes = [8 + 400 * cal.counts[i] / total for i in used]
            colour = COLOURS.get(cal.name)
            top.plot(xs, ys, color=colour, linewidth=1.2, label=f"{cal.name} (ECE {cal.ece:.3f})")
            top.scatter(xs, ys, s=sizes, color=colour, alpha=0.6)
            width = (cal.bin_edges[1] - cal.bin_edges[0]) / 3
            offset = {"a": -width, "b": 0.0, "tie": width}.get(cal.name, 0.0)
            bottom.bar([c + offset for c in centres], cal.counts, width=width, color=colour, alpha=0.7)
        top.set_xlim(0, 1)
        top.set_ylim(0, 1)
        top.set_ylabel("observed frequency")
        top.set_title(f"{title} ({metrics.n:,} battles, log loss {metrics.log_loss:.4f})")
        top.legend(loc="upper left", fontsize=8)
        bottom.set_xlabel("predicted probability")
        bottom.set_ylabel("count")
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=110)
        write_bytes_atomic(path, png.getvalue())
    finally:
        plt.close(fig)
    return path
