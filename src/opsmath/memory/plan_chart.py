"""The memory plan as a chart: predicted memory over the step (``Plan.timeline``), forward then backward."""
from __future__ import annotations


def plot(plan, ax=None, unconstrained_peak: bool = True):
    """Predicted memory over the step (``timeline``) as a step chart in MiB, forward then backward,
    the recompute points marked, with the budget and the resident bytes as lines (and, with
    ``unconstrained_peak``, the peak without recompute: resident + every activation). Returns the
    matplotlib Axes."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    pts = plan.timeline()
    mib = [b / 2**20 for _, _, b in pts]
    ax.step(range(len(pts)), mib, where="post", label="predicted")
    rec = [i for i, (phase, _, _) in enumerate(pts) if phase == "recompute"]
    ax.scatter(rec, [mib[i] for i in rec], s=12, color="tab:red", label="recompute", zorder=3)
    lines = [(plan.budget_both_units()[0], "budget", "k", "--"), (plan.resident, "resident", "grey", ":")]
    if unconstrained_peak:
        lines.append((plan.resident + plan.unconstrained, "no recompute", "tab:orange", "-."))
    for b, name, color, style in lines:
        ax.axhline(b / 2**20, color=color, linestyle=style, linewidth=1, label=name)
    split = sum(1 for phase, _, _ in pts if phase == "forward")
    ax.axvline(split - 0.5, color="grey", linewidth=0.5)
    ax.set_xlabel("forward segments, then backward")
    ax.set_ylabel("MiB")
    bound = plan.predicted_peak / 2**20   # the plan's bound; the curve's top is what the step is expected to reach
    ax.set_title(f"memory plan: budget {plan.budget}, peak {max(mib):.1f} MiB over the step"
                 + (f" (bound {bound:.1f} MiB)" if round(bound, 1) != round(max(mib), 1) else ""), fontsize=9)
    ax.legend(fontsize=7)
    return ax
