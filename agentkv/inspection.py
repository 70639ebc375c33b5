"""Looking inside a session: its span map as a table and as a PNG strip coloured by state."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

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
        check_snapshot(source, "snapshot")
        return source
    if isinstance(source, (str, Path)):
        path = Path(source)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            msg = f"no snapshot at {path}"
            raise FileNotFoundError(msg) from e
        except IsADirectoryError as e:
            msg = f"{path}: a directory, expected a JSON snapshot file (Session.save_snapshot writes one)"
            raise ValueError(msg) from e
        except OSError as e:
            msg = f"{path}: cannot read the snapshot ({e.strerror or e})"
            raise ValueError(msg) from e
        except UnicodeDecodeError as e:
            msg = f"{path}: not a JSON snapshot (not UTF-8 text: {e.reason} at byte {e.start})"
            raise ValueError(msg) from e
        except json.JSONDecodeError as e:
            msg = f"{path}: not a JSON snapshot ({e})"
            raise ValueError(msg) from e
        check_snapshot(data, str(path))
        return data
    return source.snapshot()


SPAN_FIELDS: dict[str, type | tuple[type, ...]] = {
    "span_id": int,
    "kind": str,
    "state": str,
    "tier": str,
    "start": int,
    "tokens": int,
    "held_tokens": int,
}
"""What `inspect` reads from every span of a snapshot, and the type it must have."""


def check_snapshot(data: object, where: str) -> None:
    """Raise a `ValueError` naming the first thing a snapshot lacks (file, span index, key).

    A hand-edited or truncated snapshot must give a message, not a `KeyError` traceback.
    """
    if not isinstance(data, dict):
        got = type(data).__name__
        msg = f"{where}: expected a session snapshot (a JSON object with 'spans' and 'stats'), got {got}"
        raise ValueError(msg)
    missing = [key for key in ("spans", "stats") if key not in data]
    if missing:
        names = ", ".join(map(repr, missing))
        msg = f"{where}: not a session snapshot: missing {names} (write one with session.save_snapshot)"
        raise ValueError(msg)
    if not isinstance(data["stats"], dict):
        msg = f"{where}: 'stats' must be an object, got {type(data['stats']).__name__}"
        raise ValueError(msg)
    if not isinstance(data["spans"], list):
        msg = f"{where}: 'spans' must be a list, got {type(data['spans']).__name__}"
        raise ValueError(msg)
    for index, span in enumerate(data["spans"]):
        if not isinstance(span, dict):
            msg = f"{where}: spans[{index}] must be an object, got {type(span).__name__}"
            raise ValueError(msg)
        for key, kind in SPAN_FIELDS.items():
            if key not in span:
                msg = f"{where}: spans[{index}] has no {key!r}; every span needs {', '.join(SPAN_FIELDS)}"
                raise ValueError(msg)
            value = span[key]
            if not isinstance(value, kind) or isinstance(value, bool):
                msg = (
                    f"{where}: spans[{index}].{key} must be {getattr(kind, '__name__', kind)}, got {value!r}"
                )
                raise ValueError(msg)
        if not isinstance(span.get("bytes", 0), int):
            msg = f"{where}: spans[{index}].bytes must be int, got {span['bytes']!r}"
            raise ValueError(msg)


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


TIER_HATCHES: dict[str, str | None] = {
    "device": None,
    "attended_quantized": "--",
    "host": "//",
    "quantized": "..",
    "dropped": "xx",
}
"""How the span strip draws each tier (`agentkv.spans.Tier` values): full precision in attention is plain."""
TIER_LABELS = {"attended_quantized": "attended-q"}
"""Short names in the span table for tiers whose value would widen it past an 80-column console."""

SPAN_COLUMNS = ("id", "kind", "owner", "state", "tier", "pin", "tokens", "held", "bytes", "preview")
"""The span table's columns, in order."""
SHRINKING_COLUMNS = ("owner", "preview")
"""Columns that give up width (cut with an ellipsis) when the terminal is narrow; the rest never wrap."""
NUMERIC_COLUMNS = ("id", "tokens", "held", "bytes")


def span_table(snapshot: dict[str, Any]) -> Table:
    """The span map as a rich table: one row per span, in logical order.

    On a narrow terminal only the owner and preview columns shrink: ids, kinds,
    states, tiers and sizes stay whole on one line, so an 80-column console still
    reads one row per span.
    """
    rows = [_span_row(span) for span in snapshot["spans"]]
    table = Table(
        title=f"session {snapshot.get('session_id', '?')}", box=box.SIMPLE_HEAD, padding=0, pad_edge=False
    )
    for index, column in enumerate(SPAN_COLUMNS):
        justify: Literal["right", "left"] = "right" if column in NUMERIC_COLUMNS else "left"
        if column in SHRINKING_COLUMNS:  # collapsible column; its cells never wrap (`_cell`)
            table.add_column(column, justify=justify, overflow="ellipsis")
        else:
            width = max([len(column), *(Text.from_markup(row[index]).cell_len for row in rows)])
            table.add_column(column, justify=justify, no_wrap=True, width=width)
    for row in rows:
        table.add_row(
            *(_cell(v) if c in SHRINKING_COLUMNS else v for c, v in zip(SPAN_COLUMNS, row, strict=True))
        )
    return table


def _cell(markup: str) -> Text:
    """A cell cut with an ellipsis rather than wrapped onto more lines."""
    text = Text.from_markup(markup)
    text.no_wrap = True
    text.overflow = "ellipsis"
    return text


def _span_row(span: dict[str, Any]) -> list[str]:
    state = str(span["state"])
    return [
        str(span["span_id"]),
        str(span["kind"]),
        escape(str(span.get("owner") or "")),
        f"[{STATE_COLOURS.get(state, 'white')}]{escape(state)}[/]",
        TIER_LABELS.get(str(span["tier"]), str(span["tier"])),
        "📌" if span.get("pinned") else "",
        str(span["tokens"]),
        str(span["held_tokens"]),
        _human(int(span.get("bytes", 0))),
        escape(message_text(str(span.get("preview", "")))[:40]),
    ]


_TEMPLATE_MARKERS = re.compile(r"<\|[^|<>]*\|>|</?s>|\[/?INST\]|<(?:start|end)_of_turn>")
"""Chat-template markers in a decoded span: ChatML / Llama 3 `<|...|>`, `<s>`, `[INST]`, Gemma turns."""
_ROLE_LINE = re.compile(r"^(?:system|user|assistant|tool|ipython|model)\b[^\S\n]*\n", re.IGNORECASE)
"""The role header a template writes before a message's text."""


def message_text(preview: str) -> str:
    """The message text of a span's decoded preview: template markers and role header gone, one line."""
    text = _TEMPLATE_MARKERS.sub(" ", preview).strip()
    text = _ROLE_LINE.sub("", text, count=1)
    return " ".join(text.split())


def stats_table(snapshot: dict[str, Any]) -> Table:
    """The headline stats of a snapshot."""
    stats = snapshot["stats"]
    table = Table(title="stats", show_header=False)
    table.add_column("name")
    table.add_column("value", justify="right")
    for key in ("prefill_tokens", "reused_tokens", "attended_tokens", "logical_tokens", "turn"):
        table.add_row(key, str(stats.get(key)))
    for key in ("device_bytes", "quantized_bytes", "host_bytes", "peak_device_bytes"):
        value = stats.get(key, 0)
        table.add_row(key, _human(value) if isinstance(value, int) else str(value))
    by_state = stats.get("tokens_by_state", {})
    shown = (
        ", ".join(f"{k}={v}" for k, v in by_state.items()) if isinstance(by_state, dict) else str(by_state)
    )
    table.add_row("tokens_by_state", shown)
    by_tier = stats.get("tokens_by_tier", {})
    if isinstance(by_tier, dict) and by_tier:
        table.add_row("tokens_by_tier", ", ".join(f"{k}={v}" for k, v in by_tier.items() if v))
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
    import matplotlib.pyplot as plt

    figure = span_strip_figure(load_snapshot(source))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def span_strip_figure(snapshot: dict[str, Any]) -> Figure:
    """The strip of `plot_span_strip` as a matplotlib figure (the caller closes it).

    The legend sits in its own row under the axis label (constrained layout, placed
    outside the axes), so the two never overlap whatever the figure's size.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(12, 2.2), layout="constrained")
    for span in snapshot["spans"]:
        tier = span["tier"]
        ax.barh(
            0,
            span["tokens"],
            left=span["start"],
            color=STATE_COLOURS.get(span["state"], "#999999"),
            edgecolor="black",
            linewidth=0.3,
            hatch=TIER_HATCHES.get(tier, "xx"),
        )
    ax.set_yticks([])
    ax.set_xlabel("logical position (tokens)")
    ax.set_title(
        f"session {snapshot.get('session_id', '?')}: spans by state "
        "(hatched: quantized in attention --, host //, quantized archive .., dropped xx)"
    )
    fig.legend(
        handles=[Patch(color=c, label=s) for s, c in STATE_COLOURS.items()],
        ncol=len(STATE_COLOURS),
        loc="outside lower center",
        frameon=False,
    )
    return fig
