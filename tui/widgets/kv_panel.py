"""The live KV panel. It reads only engine.stats, engine.pool.usage() and Generation results:
the numbers `localkv run --verbose` prints, so the two never disagree."""

from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Label, Sparkline, Static

from localkv.stats import Stats
from localkv.units import format_size

SEGMENTS = (("used", "█"), ("shared", "▓"), ("cached", "▒"), ("free", "░"))
# rows of the counter block: KVPanel.shown keys, a pair shares one row
LINES = (
    ("blocks",),
    ("used", "shared"),
    ("cached",),
    ("free",),
    ("kv bytes",),
    ("kv/token",),
    ("cow copies",),
    ("reuse last",),
    ("reuse total",),
    ("disk hits",),
    ("policy",),
    ("budget",),
    ("evictions",),
    ("offloads", "recalls"),
)
SPEC_LINES = (("spec",), ("drafted", "accepted"), ("tok/verify",))  # under --spec ngram only


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """Everything the panel shows, copied at one moment. Taken in the thread that runs the
    engine (the generation worker), or on the UI thread while the engine is idle: the pool's
    free queue and the event deque must not be iterated while another thread changes them."""

    usage: dict
    stats: Stats  # a copy of engine.stats, with its last few events
    policy: str
    budget: int | None
    spec: str = "off"  # --spec

    @classmethod
    def of(cls, engine, n_events: int = 6) -> "KVSnapshot":
        evict, spec = engine.config.evict, engine.config.spec
        return cls(engine.pool.usage(), engine.stats.snapshot(n_events), evict.policy, evict.budget, spec)


def bar_widths(counts: list[int], width: int) -> list[int]:
    """Cells per segment: proportional, but a non-empty segment always gets at least one cell
    (3 used blocks of 22,000 must still show), taken from the widest."""
    total = sum(counts)
    if not total or width <= 0:
        return [0] * len(counts)
    cells = [max(1, round(c * width / total)) if c else 0 for c in counts]
    while sum(cells) != width:
        i = max(range(len(cells)), key=lambda j: cells[j])
        if sum(cells) > width and cells[i] <= 1:
            break
        cells[i] += 1 if sum(cells) < width else -1
    return cells


class PoolBar(Widget):
    """The block pool as used / shared / cached-free / free cells, and a legend under it."""

    DEFAULT_CSS = """
    PoolBar {
        height: 2;
    }
    PoolBar > .poolbar--used { color: $error; }
    PoolBar > .poolbar--shared { color: $warning; }
    PoolBar > .poolbar--cached { color: $success; }
    PoolBar > .poolbar--free { color: $foreground 30%; }
    """

    COMPONENT_CLASSES = {f"poolbar--{name}" for name, _ in SEGMENTS}
    usage: reactive[dict | None] = reactive(None)

    def render(self) -> Text:
        u = self.usage or {"used": 0, "shared": 0, "cached_free": 0, "free": 0}
        counts = [u["used"] - u["shared"], u["shared"], u["cached_free"], u["free"]]
        styles = [self.get_component_rich_style(f"poolbar--{name}") for name, _ in SEGMENTS]
        bar = Text.assemble(
            *((ch * n, st) for (_, ch), n, st in zip(SEGMENTS, bar_widths(counts, self.size.width), styles))
        )
        legend = Text.assemble(*(item for (name, ch), st in zip(SEGMENTS, styles) for item in ((ch, st), f"{name} ")))
        return Text("\n").join([bar, legend])


class KVPanel(VerticalScroll):
    """The docked side panel: set `snapshot` (a KVSnapshot) and `last_turn`; rates come from the worker."""

    DEFAULT_CSS = """
    KVPanel {
        dock: right;
        width: 34;
        padding: 0 1;
        border-left: vkey $primary 50%;
        background: $panel;
        scrollbar-size-vertical: 1;
    }
    KVPanel .title {
        text-style: bold;
        color: $accent;
        margin-top: 1;
    }
    KVPanel #kv-events {
        color: $text-muted;
    }
    KVPanel Sparkline {
        height: 2;
        margin-bottom: 1;
    }
    """

    snapshot: reactive[KVSnapshot | None] = reactive(None, init=False)
    last_turn: reactive[tuple[int, int] | None] = reactive(None, init=False)  # (cached, prompt) tokens

    def __init__(self, **kw):
        super().__init__(**kw)
        self.shown: dict[str, str] = {}  # label -> the value as displayed (tests read it)

    def compose(self) -> ComposeResult:
        yield Label("KV cache", classes="title")
        yield PoolBar()
        yield Static(id="kv-stats", markup=False)
        yield Label("events", classes="title")
        yield Static("none yet", id="kv-events", markup=False)
        yield Label("tokens/s", classes="title")
        yield Static("-", id="kv-rate", markup=False)
        yield Sparkline([], id="kv-spark")

    def add_rate(self, tps: float, when: str) -> None:
        """A tokens/s sample: into the sparkline, and shown as the rate `when` ("now", "last reply")."""
        spark = self.query_one(Sparkline)
        spark.data = [*(spark.data or [])[-59:], tps]
        self.query_one("#kv-rate", Static).update(f"{tps:.1f} {when}")

    def on_mount(self) -> None:
        self._render_stats()  # a snapshot given before the children were mounted

    def watch_snapshot(self) -> None:
        self._render_stats()

    def watch_last_turn(self) -> None:
        self._render_stats()

    def _render_stats(self) -> None:
        snap, bars = self.snapshot, self.query(PoolBar)
        # a timer or a fast engine load can fire before the children are mounted (on_mount
        # renders then) or while the screen is torn down
        if snap is None or not self.is_attached or not bars:
            return
        u, s = snap.usage, snap.stats
        bars.first().usage = u
        last = self.last_turn
        hit_pct = f" ({100 * s.prefix_hits / s.prefix_queries:.0f}%)" if s.prefix_queries else ""
        self.shown = {
            "blocks": f"{u['blocks']} × {u['block_size']} tok",
            "used": str(u["used"]),
            "shared": str(u["shared"]),
            "cached": str(u["cached_free"]),
            "free": str(u["free"]),
            "kv bytes": format_size(u["used"] * u["bytes_per_block"]),
            "kv/token": f"{format_size(u['bytes_per_block'] // u['block_size'])} {u['kv_dtype']}",
            "cow copies": str(s.cow_copies),
            "reuse last": f"{last[0]}/{last[1]} tok" if last else "-",
            "reuse total": f"{s.prefix_hits}/{s.prefix_queries}{hit_pct}",
            "disk hits": str(s.disk_hits),
            "policy": snap.policy,
            "budget": "-" if snap.budget is None else f"{snap.budget} tok",
            "evictions": str(s.evictions),
            "offloads": str(s.offloads),
            "recalls": str(s.recalls),
        }
        lines = LINES
        if snap.spec != "off":
            lines += SPEC_LINES
            self.shown |= {
                "spec": snap.spec,
                "drafted": str(s.drafted),
                "accepted": f"{s.accepted}" + (f" ({100 * s.accepted / s.drafted:.0f}%)" if s.drafted else ""),
                # tokens a verify pass yields: its accepted drafts and the one it samples after them
                "tok/verify": f"{(s.accepted + s.verify_passes) / s.verify_passes:.2f}" if s.verify_passes else "-",
            }
        self.query_one("#kv-stats", Static).update(
            "\n".join(
                "".join(f"{k:<12}{self.shown[k]}" if i == 0 else f"  {k} {self.shown[k]}" for i, k in enumerate(keys))
                for keys in lines
            )
        )
        self.query_one("#kv-events", Static).update(
            "\n".join(
                f"{e.kind:<8}blk {e.block} @{e.positions[0]}-{e.positions[1]}" + (f" {e.score:.2f}" if e.score else "")
                for e in s.events
            )
            or "none yet"
        )
