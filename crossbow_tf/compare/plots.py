"""The figures. Every one is drawn inside ``figure``, which owns matplotlib's set-up (the Agg
backend, size, grid, legend, resolution), so the figures differ only in what they draw."""
import contextlib


@contextlib.contextmanager
def figure(path, legend_fontsize=8):
    """An axes to draw on; on leaving, its grid and legend, then PATH written and the figure closed."""
    import matplotlib   # imported here: the harness's other work needs no plotting library
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        yield ax
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_fontsize)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def plot_curves(curves_by_name, target, path_time, path_epochs):
    """Accuracy against training time and against epochs, one colour per method, one line per seed."""
    for path, xkey, xlabel in ((path_time, "wall_time", "training time (s, evaluation excluded)"),
                               (path_epochs, "epoch", "epoch")):
        with figure(path) as ax:
            for i, (name, curves) in enumerate(curves_by_name.items()):
                color = f"C{i}"
                for j, (seed, evals) in enumerate(curves):
                    ax.plot([e[xkey] for e in evals], [e["accuracy"] for e in evals], "o-", color=color,
                            markersize=3, linewidth=1.2, alpha=0.85, label=name if j == 0 else None)
            ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:.0%}")
            low = min([e["accuracy"] for curves in curves_by_name.values() for _, ev in curves for e in ev] + [target])
            ax.set_ylim(max(0.0, min(low, target - 0.1) - 0.02), 1.0)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("test accuracy")


def plot_sweep(series, epochs_cap, target, path):
    """Epochs to target against global batch; SERIES {label: [(global_batch, epochs or None)]}."""
    with figure(path) as ax:
        for i, (label, points) in enumerate(series.items()):
            xs = [b for b, _ in points]
            ys = [e if e is not None else epochs_cap for _, e in points]
            # Distinct line styles: equal values would otherwise hide one series under the other.
            ax.plot(xs, ys, ["-", "--"][i % 2], color=f"C{i}", label=label, linewidth=1.5)
            for x, (_, e), y in zip(xs, points, ys):
                ax.plot([x], [y], ("o" if i % 2 == 0 else "s") if e is not None else "^", color=f"C{i}",
                        markersize=8 - 3 * (i % 2), markerfacecolor=f"C{i}" if e is not None else "white")
        ax.set_ylim(bottom=0)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global batch (S-SGD: batch; SMA: k x b)")
        ax.set_ylabel(f"epochs to {target:.0%} test accuracy")
        ax.set_title(f"statistical efficiency (open triangles: not reached in {epochs_cap} epochs)", fontsize=9)


def plot_best_accuracy(stats, series, points, spec, path, series_label):
    """Median best accuracy within the cap against G per series: where epochs to target sit at the
    cap, this still separates the methods."""
    with figure(path, legend_fontsize=7) as ax:
        for i, s in enumerate(series):
            pts = [(g, stats[(s.name, g)]["best_accuracy"]) for g in points if stats.get((s.name, g))
                   and stats[(s.name, g)]["best_accuracy"][0] is not None]
            if not pts:
                continue
            gs, meds = [g for g, _ in pts], [a[0] for _, a in pts]
            low = [m - a[1] for m, (_, a) in zip(meds, pts)]
            high = [a[2] - m for m, (_, a) in zip(meds, pts)]
            ax.errorbar(gs, meds, yerr=[low, high], fmt="o", color=f"C{i}", capsize=3, label=series_label(s),
                        linestyle="--" if s.beyond_crossbow else "-")
        ax.axhline(spec.target, color="gray", linestyle=":", linewidth=1, label=f"target {spec.target:.0%}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global batch G")
        ax.set_ylabel(f"best test accuracy in {spec.epochs} epochs\n(median; bars: range over seeds)")
        ax.set_ylim(bottom=max(0.0, min([spec.target - 0.15] + [
            stats[(s.name, g)]["best_accuracy"][1] for s in series for g in points
            if stats.get((s.name, g)) and stats[(s.name, g)]["best_accuracy"][1] is not None and
            stats[(s.name, g)]["best_accuracy"][1] > 0.5])))


def plot_tta(stats, cells, spec, path, devices="this CPU"):
    """Median TTA against G per series; DEVICES: what the study trained on ("this CPU", "these 8 GPUs")."""
    with figure(path) as ax:
        names = [c.series.name for c in cells]
        for i, name in enumerate(dict.fromkeys(names)):
            pts = sorted((g, s["tta"][0]) for (n, g), s in stats.items() if n == name and s and s["tta"][0] is not None)
            if pts:
                ax.plot([g for g, _ in pts], [t for _, t in pts], "o-", color=f"C{i}", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global batch G")
        ax.set_ylabel(f"time to {spec.target:.0%} (s of training, {devices})")


def plot_largest(states, spec, g, path):
    """Accuracy against epochs at global batch G: each series' best trial (seed 0); SMA's learner 0 dashed."""
    with figure(path, legend_fontsize=7) as ax:
        i = 0
        for (name, gg), st in states.items():
            if gg != g or not st["final"]:
                continue
            run = next((r for r in st["final"].values() if r is not None and r[1]), None)
            if run is None:
                continue
            evals = run[1]
            ax.plot([e["epoch"] for e in evals], [e["accuracy"] for e in evals], "o-", color=f"C{i}", markersize=3,
                    label=f"{name} z" if st["cell"].series.method == "sma" else name)
            if any("learner_accuracy" in e for e in evals):
                ax.plot([e["epoch"] for e in evals], [e.get("learner_accuracy") for e in evals], "--", color=f"C{i}",
                        linewidth=1, label=f"{name} learner 0")
            i += 1
        ax.axhline(spec.target, color="gray", linestyle=":", linewidth=1, label=f"target {spec.target:.0%}")
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"global batch {g}: best trial of each series (seed 0)", fontsize=9)
