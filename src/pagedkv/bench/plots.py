"""PNG plots of a results document (needs matplotlib: the ``bench`` extra).

* ``throughput_vs_concurrency.png``: output tokens/s against concurrency, one line per system;
* ``ttft_vs_prefix.png``: TTFT p50 against the shared-prefix length, prefix caching on and off;
* ``mixed_throughput.png``: output tokens/s of each system on the mixed workload.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def available() -> bool:
    """Whether matplotlib is installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plots(document: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write every plot the document has data for; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    workloads = document.get("workloads", {})
    subtitle = _subtitle(document)
    written: list[Path] = []
    scaling = workloads.get("scaling", {}).get("figures", {})
    if "throughput_tokens_per_s" in scaling:
        written.append(_throughput(scaling, subtitle, out_dir / "throughput_vs_concurrency.png"))
    prefix = workloads.get("shared_prefix", {}).get("figures", {})
    if len(prefix.get("prefix_sweep", {})) > 1:
        written.append(_ttft(prefix, subtitle, out_dir / "ttft_vs_prefix.png"))
    mixed = workloads.get("mixed", {}).get("figures", {})
    if "systems" in mixed:
        written.append(_mixed(mixed, subtitle, out_dir / "mixed_throughput.png"))
    return written


def _subtitle(document: dict[str, Any]) -> str:
    machine = document.get("machine", {})
    return (
        f"{machine.get('cpu_model', '?')}, {machine.get('torch_threads', '?')} thread(s), "
        f"torch {machine.get('torch', '?')}, {document.get('date', '')[:10]}"
    )


def _throughput(figures: dict[str, Any], subtitle: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for system, points in figures["throughput_tokens_per_s"].items():
        xs = [int(level) for level, v in points.items() if v is not None]
        ys = [v for v in points.values() if v is not None]
        ax.plot(xs, ys, marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    levels = figures.get("spec", {}).get("levels", [])
    ax.set_xticks(levels, [str(x) for x in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s (log)")
    spec = figures.get("spec", {})
    ax.set_title(
        f"Throughput vs concurrency (prompt {spec.get('prompt_len')}, "
        f"output {spec.get('output_len')} tokens)\n{subtitle}",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _ttft(figures: dict[str, Any], subtitle: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    sweep = figures["prefix_sweep"]
    lengths = sorted(int(k) for k in sweep)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    styles = {
        "sequential_cache_on": ("cache on, sequential arrival (warm prefix)", "o-"),
        "sequential_cache_off": ("cache off, sequential arrival", "s-"),
        "burst_cache_on": ("cache on, burst arrival (p50 incl. queueing)", "o--"),
        "burst_cache_off": ("cache off, burst arrival (p50 incl. queueing)", "s--"),
    }
    for key, (label, style) in styles.items():
        ys = [sweep[str(n)].get(key, {}).get("ttft_p50_ms") for n in lengths]
        if all(y is not None for y in ys):
            ax.plot(lengths, ys, style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_yscale("log")
    ax.set_xlabel("shared prefix length (tokens)")
    ax.set_ylabel("TTFT p50 (ms, log)")
    ax.set_title(f"TTFT vs shared-prefix length, pagedkv v1\n{subtitle}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _mixed(figures: dict[str, Any], subtitle: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    systems = figures["systems"]
    names = list(systems)
    values = [systems[n]["output_tokens_per_s"] or 0.0 for n in names]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    bars = ax.barh(names, values)
    ax.bar_label(bars, fmt="%.0f", fontsize=8, padding=2)
    ax.margins(x=0.12)
    ax.set_xlabel("output tokens/s")
    ax.set_title(f"Mixed workload ({figures.get('num_requests')} requests)\n{subtitle}", fontsize=9)
    ax.invert_yaxis()
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
