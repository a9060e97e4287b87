"""Summaries of a run: the paper's Table 3 (phases) and Table 4 (per chunk) as text, and PNG plots.

:func:`phase_table` and :func:`chunk_table` read what the training loop wrote to ``metrics.jsonl``
and always work; :func:`summarise` prints them at the end of a run and writes ``OUT/summary.md``. :func:`write_plots` draws the loss curve and the per-chunk D2H / accumulate / H2D
bars with matplotlib, an optional dependency: without it, it returns a note and draws nothing.
Medians, not means, since the first steps (allocation, Numba compilation, tuning) are outliers.
"""
from __future__ import annotations

import pathlib
import statistics

from cgdp.cli.config import Config
from cgdp.cli.output import disk_error, earlier_steps, write_text

PHASES = ("forward_s", "backward_s", "exposed_comm_s", "update_s", "step_s")


def phase_table(rows: list[dict], skip: int = 2) -> str:
    """Median phase times (ms) over the step rows after the first ``skip`` (Table 3's columns), and
    "other", the rest of the step, so that the row adds up to "step"."""
    steps = [r for r in rows if r.get("kind") == "step"]
    steps = steps[skip:] if len(steps) > skip else steps
    if not steps:
        return "no steps recorded"
    med = {k: statistics.median(r[k] for r in steps) * 1e3 for k in PHASES}
    other = med["step_s"] - sum(med[k] for k in PHASES[:-1])
    head = "| forward | backward | exposed comm. after backward | update | other | step |"
    vals = "| " + " | ".join(f"{med[k]:.3f}" for k in PHASES[:-1]) + f" | {other:.3f} | {med['step_s']:.3f} |"
    legend = ("other: the rest of the step, the host's work between the phases (handing each phase to the "
              "devices' threads and collecting it, the loss weights, the gradient norm and clipping); each "
              "phase is the slowest device's")
    return (f"Phases of one iteration, median of {len(steps)} steps (ms):\n\n{head}\n|---|---|---|---|---|---|\n"
            f"{vals}\n\n{legend}\n")


def chunk_table(profile: dict, layer_names: list[str] | None = None) -> str:
    """Per chunk, in send order: layers, parameters, D2H, accumulate, H2D (Table 4's rows)."""
    lines = ["| chunk | layers | params (M) | D2H (ms) | accumulate (ms) | H2D (ms) |",
             "|---|---|---|---|---|---|"]
    for c in profile.get("chunks", []):
        layers = c["layers"]
        label = ",".join(str(i) for i in layers)
        if layer_names and len(layers) == 1:
            label += f" ({layer_names[layers[0]]})"
        params = c["bytes"] / 4e6  # float32 gradients
        lines.append(f"| {c['index']} | {label} | {params:.3f} | {c['d2h_s'] * 1e3:.3f} | "
                     f"{c['acc_s'] * 1e3:.3f} | {c['h2d_s'] * 1e3:.3f} |")
    return "Per chunk (send order = backward order):\n\n" + "\n".join(lines) + "\n"


def summarise(out: pathlib.Path | None, cfg: Config, rows: list[dict], profile: dict | None,
              layer_names: list[str], tuner: str | None, resumed_at: int | None) -> None:
    """Print the run's tables, write them to ``out/summary.md`` and the plots (``resumed_at``: the
    step a resumed run started from; its loss curve still starts at step 1)."""
    mode = cfg.train.mode
    profile = profile if mode == "cgdp" else None  # no chunk goes through the host: all its times are 0
    text = [phase_table(rows)] + ([tuner + "\n"] if tuner else [])
    if profile is not None:
        text.append(chunk_table(profile, layer_names))
    else:
        why = (f"mode {mode!r} has no per-chunk host transfers to profile" if mode != "cgdp" else
               "profile_every = 0" if cfg.run.profile_every <= 0 else "no step was profiled")
        text.append(f"Per chunk: no profiled step in this run ({why}).\n")
    summary = "\n".join(text)
    print(summary)
    if out is None:
        return
    kept = f"the checkpoint and metrics.jsonl in {out} are intact (the run itself is complete)"
    write_text(out / "summary.md", summary, kept)
    if cfg.run.plots:
        steps = [r for r in rows if r.get("kind") == "step"]
        earlier = earlier_steps(out / "metrics.jsonl", resumed_at) if resumed_at is not None else []
        try:
            print(write_plots(out, earlier + steps, profile))
        except OSError as e:
            raise disk_error(e, out / "summary.png", kept) from None


def write_plots(out: pathlib.Path, rows: list[dict], profile: dict | None) -> str:
    """Write ``out/summary.png``; return a note saying what was written or why not."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return "plots skipped: matplotlib is not installed (pip install matplotlib, or cgdp[plot])"
    steps = [r for r in rows if r.get("kind") == "step"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=1)
    ax.set(xlabel="step", ylabel="training loss", title="Loss", yscale="log")
    ax = axes[1]
    chunks = (profile or {}).get("chunks", [])
    if chunks:
        x = range(len(chunks))
        w = 0.27
        for i, (key, label) in enumerate((("d2h_s", "D2H"), ("acc_s", "accumulate"), ("h2d_s", "H2D"))):
            ax.bar([j + (i - 1) * w for j in x], [c[key] * 1e3 for c in chunks], w, label=label)
        ax.set_xticks(list(x), [",".join(map(str, c["layers"])) for c in chunks],
                      rotation=90 if len(chunks) > 8 else 0, fontsize=7)
        ax.set(xlabel="chunk (layers, backward order)", ylabel="ms", title="Per-chunk copy and accumulate")
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no profiled step (mode without host accumulation, or profile_every = 0)",
                ha="center", va="center", wrap=True)
        ax.set_axis_off()
    fig.tight_layout()
    path = out / "summary.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plots written to {path}"
