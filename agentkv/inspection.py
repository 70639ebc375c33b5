"""Looking inside a session: its span map as a table and as a PNG strip coloured by state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from agentkv.backend.session import Session

STATE_COLOURS = {
    "active": "#4c9be8",
    "committed": "#3cb371",
    "archived": "#f0ad4e",
    "evictable": "#d9a3e6",
    "evicted": "#b0b0b0",
}


def load_snapshot(source: Session | dict[str, Any] | str | Path) -> dict[str, Any]:
    """A snapshot dict from a live session, a dict, or a JSON file written by `Session.save_snapshot`."""
    if isinstance(source, dict):
        return source
    if isinstance(source, (str, Path)):
        path = Path(source)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            msg = f"no snapshot at {path}"
            raise FileNotFoundError(msg) from e
        except json.JSONDecodeError as e:
            msg = f"{path}: not a JSON snapshot ({e})"
            raise ValueError(msg) from e
        if not isinstance(data, dict) or "spans" not in data:
            msg = f"{path}: expected a session snapshot with 'spans' and 'stats'"
            raise ValueError(msg)
        return data
    return source.snapshot()


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def span_table(snapshot: dict[str, Any]) -> Table:
    """The span map as a rich table: one row per span, in logical order."""
    table = Table(title=f"session {snapshot.get('session_id', '?')}", show_lines=False)
    for column in ("id", "kind", "owner", "state", "tier", "pin", "tokens", "held", "bytes", "preview"):
        table.add_column(column, justify="right" if column in ("id", "tokens", "held", "bytes") else "left")
    for span in snapshot["spans"]:
        state = str(span["state"])
        preview = str(span.get("preview", "")).replace("\n", "⏎")[:40]
        table.add_row(
            str(span["span_id"]),
            str(span["kind"]),
            str(span.get("owner") or ""),
            f"[{STATE_COLOURS.get(state, 'white')}]{state}[/]",
            str(span["tier"]),
            "📌" if span.get("pinned") else "",
            str(span["tokens"]),
            str(span["held_tokens"]),
            _human(int(span.get("bytes", 0))),
            preview,
        )
    return table


def stats_table(snapshot: dict[str, Any]) -> Table:
    """The headline stats of a snapshot."""
    stats = snapshot["stats"]
    table = Table(title="stats", show_header=False)
    table.add_column("name")
    table.add_column("value", justify="right")
    for key in ("prefill_tokens", "reused_tokens", "attended_tokens", "logical_tokens", "turn"):
        table.add_row(key, str(stats.get(key)))
    for key in ("device_bytes", "quantized_bytes", "host_bytes", "peak_device_bytes"):
        table.add_row(key, _human(int(stats.get(key, 0))))
    table.add_row(
        "tokens_by_state", ", ".join(f"{k}={v}" for k, v in stats.get("tokens_by_state", {}).items())
    )
    table.add_row("events applied / no-op", f"{stats.get('events_applied')} / {stats.get('events_noop')}")
    table.add_row("budget satisfied", str(stats.get("budget_satisfied")))
    return table


def print_inspection(source: Session | dict[str, Any] | str | Path, console: Console | None = None) -> None:
    """Print the span map and stats."""
    snapshot = load_snapshot(source)
    console = console or Console()
    console.print(span_table(snapshot))
    console.print(stats_table(snapshot))


def plot_span_strip(source: Session | dict[str, Any] | str | Path, path: str | Path) -> Path:
    """A PNG strip: one bar per span, as wide as its tokens, coloured by state, hatched off the device."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    snapshot = load_snapshot(source)
    spans = snapshot["spans"]
    fig, ax = plt.subplots(figsize=(12, 1.8))
    for span in spans:
        tier = span["tier"]
        ax.barh(
            0,
            span["tokens"],
            left=span["start"],
            color=STATE_COLOURS.get(span["state"], "#999999"),
            edgecolor="black",
            linewidth=0.3,
            hatch=None
            if tier == "device"
            else ("//" if tier == "host" else ".." if tier == "quantized" else "xx"),
        )
    ax.set_yticks([])
    ax.set_xlabel("logical position (tokens)")
    ax.set_title(
        f"session {snapshot.get('session_id', '?')}: spans by state "
        "(hatched: host //, quantized .., dropped xx)"
    )
    ax.legend(
        handles=[Patch(color=c, label=s) for s, c in STATE_COLOURS.items()],
        ncol=5,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.45),
        frameon=False,
    )
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
