"""The learning-curve figure of the RL examples (PPO and A3C)."""

from __future__ import annotations


def plot_learning_curve(
    history: list[dict[str, float]], path: str, title: str, target_return: float = 475.0
) -> None:
    """Writes the smoothed training return (``history[i]["return_smoothed"]``) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["env_steps"] for r in history]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    ax.plot(steps, [r["return_smoothed"] for r in history], label="training return")
    ax.axhline(target_return, color="gray", linestyle="--", linewidth=1, label="target 475")
    ax.set_xlabel("environment steps")
    ax.set_ylabel("mean episode return")
    ax.set_ylim(0, 520)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
