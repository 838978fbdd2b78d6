#!/usr/bin/env python
"""Draw learning curves from one or more runs' ``metrics.jsonl`` into one PNG, and summarise each run.

    python scripts/plot_metrics.py OUTPUT_DIR [OUTPUT_DIR ...] [--out FILE.png] [--title T]

Each OUTPUT_DIR is a trainer ``--output-dir`` holding ``metrics.jsonl`` (one JSON object per epoch,
written by ``imagenet.training.runlog``). The figure is a grid of panels: loss (train dashed, val solid),
Acc@1 (train dashed, val solid, the best val epoch starred), learning rate (at each epoch's first
step), training img/s, loss scale (log y; "no loss scaling" when a run has none) and skipped
steps/images per epoch. Several dirs overlay as lines of their own colour, labelled with the dir
name, so runs can be compared (e.g. fp32 against fp16):

    python scripts/plot_metrics.py runs/r50-fp32 runs/r50-fp16 --out r50.png --title "ResNet-50, 1 H200"

Output: ``OUTPUT_DIR/curves.png`` for one dir, ``./curves.png`` for several, unless ``--out`` says
otherwise. A one-paragraph summary per run goes to stdout (epochs, best and last val Acc@1, median
img/s, skipped images and overflow steps).

A resumed run may have written an epoch twice; the later record of that epoch is kept. A missing
or empty ``metrics.jsonl``, a line that is not a JSON object, an unwritable ``--out`` or a missing
matplotlib (an optional dependency: ``pip install matplotlib``) stop with one ``error:`` line and
exit status 2.
"""

import argparse
import json
import math
import os
import statistics
import sys
from typing import Dict, List

EXIT_USER_ERROR = 2
METRICS = "metrics.jsonl"
DEFAULT_OUT = "curves.png"
# Numeric fields the panels and the summary read; null (or absent, in older files) plots as a gap.
NUMERIC = ("lr", "train_loss", "val_loss", "train_acc1", "val_acc1", "val_acc5", "img_per_s", "loss_scale",
           "skipped_steps", "skipped_images", "best_acc1")
# A loss curve spanning more than this factor (an early spike) is drawn on a log axis.
LOG_LOSS_RATIO = 20.0


class PlotError(Exception):
    """A problem the user can fix; printed as one ``error:`` line, exit status 2."""

    def __str__(self) -> str:  # one line, always
        return " ".join(super().__str__().split())


def _number(value, key: str, where: str) -> float:
    """A JSON value as a float: null is NaN (a gap in the plot); anything but a number is corruption."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlotError(f"{where}: {key!r} is {value!r}, not a number; the file is corrupt")
    return float(value)


def load_metrics(out_dir: str) -> List[dict]:
    """Read ``out_dir/metrics.jsonl`` into per-epoch records, sorted by epoch, one per epoch.

    Numeric fields become floats (NaN for null or absent). Raises :class:`PlotError` naming the file
    (and line) for a missing or empty file or a line that is not a JSON object.
    """
    path = os.path.join(out_dir, METRICS)
    if not os.path.isdir(out_dir):
        raise PlotError(f"{out_dir} is not a directory; pass the trainer's --output-dir")
    if not os.path.isfile(path):
        raise PlotError(f"{out_dir} has no {METRICS}; pass a trainer --output-dir that has finished an epoch")
    by_epoch: Dict[int, dict] = {}
    try:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path} line {lineno}"
                try:
                    raw = json.loads(line)
                except ValueError as e:
                    raise PlotError(f"{where} is not valid JSON ({e}); the file is corrupt "
                                    "(a run killed mid-write?): fix or delete that line") from None
                if not isinstance(raw, dict):
                    raise PlotError(f"{where} is {type(raw).__name__}, not a JSON object; the file is corrupt")
                epoch = raw.get("epoch", len(by_epoch))
                if isinstance(epoch, bool) or not isinstance(epoch, int):
                    raise PlotError(f"{where}: 'epoch' is {epoch!r}, not an integer; the file is corrupt")
                record = {key: _number(raw.get(key), key, where) for key in NUMERIC}
                record.update(epoch=epoch, precision=raw.get("precision"), mode=raw.get("mode"),
                              world_size=raw.get("world_size"), line=lineno)
                by_epoch[epoch] = record  # a resumed run may repeat an epoch: the later record wins
    except UnicodeDecodeError as e:
        raise PlotError(f"{path} is not UTF-8 text ({e}); the file is corrupt") from None
    except OSError as e:
        raise PlotError(f"cannot read {path} ({e.strerror or e})") from None
    if not by_epoch:
        raise PlotError(f"{path} is empty; no epoch has finished in that run yet")
    return [by_epoch[e] for e in sorted(by_epoch)]


def run_labels(dirs: List[str]) -> List[str]:
    """Legend labels: each dir's name, or its path as given where two dirs share a name."""
    names = [os.path.basename(os.path.normpath(os.path.abspath(d))) or d for d in dirs]
    return [os.path.normpath(d) if names.count(n) > 1 else n for d, n in zip(dirs, names)]


def _finite(values) -> List[float]:
    return [v for v in values if not math.isnan(v)]


def summarize(label: str, records: List[dict]) -> str:
    """One paragraph about a run: epochs, best/last val Acc@1, median img/s, skipped images and steps."""
    epochs = [r["epoch"] for r in records]
    first = records[-1]
    setup = ", ".join(str(x) for x in (first["precision"], first["mode"]) if x)
    if first["world_size"] and first["world_size"] != 1:
        setup += f" x{first['world_size']}"
    text = f"{label}: {len(records)} epoch{'s' if len(records) != 1 else ''} ({epochs[0]}-{epochs[-1]}"
    text += f"; {setup})" if setup else ")"
    val = [(r["val_acc1"], r["epoch"]) for r in records if not math.isnan(r["val_acc1"])]
    if val:
        best, best_epoch = max(val, key=lambda t: t[0])
        last, last_epoch = val[-1]
        text += f"; best val Acc@1 {best:.3f} (epoch {best_epoch}), last {last:.3f} (epoch {last_epoch})"
    else:
        text += "; no val Acc@1 recorded"
    speeds = _finite(r["img_per_s"] for r in records)
    text += f"; median {statistics.median(speeds):,.0f} img/s" if speeds else "; no img/s recorded"
    skipped_images = int(sum(_finite(r["skipped_images"] for r in records)))
    skipped_steps = int(sum(_finite(r["skipped_steps"] for r in records)))
    text += f"; {skipped_images} skipped image{'s' if skipped_images != 1 else ''}"
    text += f", {skipped_steps} overflow step{'s' if skipped_steps != 1 else ''} skipped"
    scales = _finite(r["loss_scale"] for r in records)
    text += f"; final loss scale {scales[-1]:g}." if scales else "; no loss scaling."
    return text


def _check_out(out: str) -> None:
    """Fail before drawing when --out obviously cannot be written."""
    parent = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise PlotError(f"--out {out} is a directory; give a file name such as {os.path.join(out, DEFAULT_OUT)}")
    if not os.path.isdir(parent):
        raise PlotError(f"cannot write --out {out}: {parent} is not an existing directory")
    if not os.access(parent, os.W_OK) or (os.path.exists(out) and not os.access(out, os.W_OK)):
        raise PlotError(f"cannot write --out {out}: permission denied")


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=11, color="0.4")


def _from_zero(ax, values) -> None:
    """A y axis from 0 with headroom above the largest value, so differences are seen to scale."""
    top = max(_finite(values), default=0.0)
    ax.set_ylim(0, top * 1.12 if top > 0 else 1.0)


def draw(runs: List[tuple], title: str, out: str) -> None:
    """Draw the panel grid for ``runs`` (``(label, records)`` pairs) and save it to ``out``."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 3, figsize=(16, 9), layout="constrained", sharex=True)
    (ax_loss, ax_acc, ax_lr), (ax_speed, ax_scale, ax_skip) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    style = dict(marker="o", markersize=3, linewidth=1.6)
    unscaled, any_skipped = [], False
    for i, (label, records) in enumerate(runs):
        color = colors[i % len(colors)]
        x = [r["epoch"] for r in records]

        def series(key, records=records):
            return [r[key] for r in records]

        def validated(key, records=records):  # the epochs --eval-every validated, joined by one line
            kept = [r for r in records if not math.isnan(r[key])]
            return [r["epoch"] for r in kept], [r[key] for r in kept]

        ax_loss.plot(x, series("train_loss"), color=color, linestyle="--", **style)
        ax_loss.plot(*validated("val_loss"), color=color, linestyle="-", **style)
        ax_acc.plot(x, series("train_acc1"), color=color, linestyle="--", **style)
        ax_acc.plot(*validated("val_acc1"), color=color, linestyle="-", **style)
        val = [(r["val_acc1"], r["epoch"]) for r in records if not math.isnan(r["val_acc1"])]
        if val:
            best, best_epoch = max(val, key=lambda t: t[0])
            ax_acc.plot([best_epoch], [best], marker="*", markersize=15, color=color,
                        markeredgecolor="black", linestyle="none", zorder=5)
            ax_acc.annotate(f"{best:.2f}", (best_epoch, best), textcoords="offset points", xytext=(0, 9),
                            ha="center", fontsize=8, color=color)
        ax_lr.plot(x, series("lr"), color=color, **style)
        ax_speed.plot(x, series("img_per_s"), color=color, **style)
        if _finite(series("loss_scale")):
            ax_scale.plot(x, series("loss_scale"), color=color, **style)
        else:
            unscaled.append(label)
        if any(_finite(series("skipped_steps"))) or any(_finite(series("skipped_images"))):
            any_skipped = True
            ax_skip.plot(x, series("skipped_steps"), color=color, linestyle="-", **style)
            ax_skip.plot(x, series("skipped_images"), color=color, linestyle=":", **style)

    losses = [v for _, recs in runs for r in recs for v in (r["train_loss"], r["val_loss"]) if v > 0]
    log_loss = bool(losses) and max(losses) / min(losses) > LOG_LOSS_RATIO
    if log_loss:
        ax_loss.set_yscale("log")
    ax_loss.set_title("Loss" + (" (log y)" if log_loss else ""))
    ax_acc.set_title("Acc@1 (%)  \u2605 best val")
    ax_lr.set_title("Learning rate (epoch's first step)")
    ax_speed.set_title("Training throughput (img/s)")
    _from_zero(ax_speed, [r["img_per_s"] for _, recs in runs for r in recs])
    ax_scale.set_title("Loss scale (log y)")
    if len(unscaled) == len(runs):
        _note(ax_scale, "no loss scaling")
        ax_scale.set_yticks([])
    else:
        ax_scale.set_yscale("log", base=2)
        if unscaled:  # in the title, where it cannot cover a curve
            ax_scale.set_title("Loss scale (log y)\nno loss scaling: " + ", ".join(unscaled))
    ax_skip.set_title("Skipped per epoch")
    if not any_skipped:
        _note(ax_skip, "nothing skipped")
        ax_skip.set_yticks([])
    else:
        _from_zero(ax_skip, [r[k] for _, recs in runs for r in recs for k in ("skipped_steps", "skipped_images")])
        ax_skip.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax_skip.legend(handles=[Line2D([], [], color="0.3", linestyle="-", label="overflow steps"),
                                Line2D([], [], color="0.3", linestyle=":", label="unreadable images")],
                       fontsize=8, loc="upper right")
    split = [Line2D([], [], color="0.3", linestyle="--", label="train"),
             Line2D([], [], color="0.3", linestyle="-", label="val")]
    ax_loss.legend(handles=split, fontsize=8, loc="upper right")
    ax_acc.legend(handles=split, fontsize=8, loc="lower right")
    ax_acc.margins(y=0.12)  # room above the best-val star and its label
    for ax in (ax_loss, ax_acc, ax_lr, ax_speed):
        if not any(_finite(float(v) for v in line.get_ydata()) for line in ax.lines):
            _note(ax, "not recorded")
    epochs = [r["epoch"] for _, recs in runs for r in recs]
    if min(epochs) == max(epochs):  # one epoch: a unit-wide axis, so the integer ticks still show
        ax_loss.set_xlim(min(epochs) - 1, max(epochs) + 1)
    for ax in axes.flat:
        ax.tick_params(labelbottom=True)  # sharex hides the top row's epoch numbers; keep them
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=14)
    fig.legend(handles=[Line2D([], [], color=colors[i % len(colors)], linewidth=2.5, label=label)
                        for i, (label, _) in enumerate(runs)],
               loc="outside lower center", ncols=min(len(runs), 5), fontsize=11, frameon=False)
    ext = os.path.splitext(out)[1].lower()
    try:
        fig.savefig(out, dpi=100, format="png" if ext in ("", ".png") else None)
    except OSError as e:
        raise PlotError(f"cannot write --out {out} ({e.strerror or e})") from None
    except ValueError as e:  # an extension matplotlib has no writer for
        raise PlotError(f"cannot write --out {out} ({e}); use a .png name") from None
    finally:
        plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; see the module docstring."""
    p = argparse.ArgumentParser(description="Plot learning curves from trainer output dirs' metrics.jsonl.")
    p.add_argument("dirs", nargs="+", metavar="OUTPUT_DIR", help="trainer --output-dir(s) holding metrics.jsonl")
    p.add_argument("--out", help=f"image to write (default: OUTPUT_DIR/{DEFAULT_OUT} for one dir, "
                                 f"./{DEFAULT_OUT} for several)")
    p.add_argument("--title", help="figure title (default: the run names)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Load every run, draw the figure, print the summaries; 0 on success, 2 with one error line."""
    args = parse_args(argv)
    try:
        runs = list(zip(run_labels(args.dirs), [load_metrics(d) for d in args.dirs]))
        out = args.out or (os.path.join(args.dirs[0], DEFAULT_OUT) if len(args.dirs) == 1 else DEFAULT_OUT)
        _check_out(out)
        try:
            import matplotlib
            matplotlib.use("Agg")  # files only: never needs a display
        except ImportError:
            raise PlotError("plotting needs matplotlib: pip install matplotlib") from None
        title = args.title or "Learning curves: " + " vs ".join(label for label, _ in runs)
        draw(runs, title, out)
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    for label, records in runs:
        print(summarize(label, records))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
