"""`localkv run --tools FILE`: the tools file read and checked before any model loads, the
reply's calls printed as JSON lines."""

import json
import sys
from pathlib import Path

from localkv.errors import LocalkvError
from localkv.toolcalls import Choice, Plan, ToolError, read_choice, read_tools
from localkv.toolcalls.spec import Tool


def load(path: Path, choice: str | None) -> tuple[list[Tool], Choice]:
    """The tools of FILE (OpenAI's `tools` array, or an object holding one) and --tool-choice."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise LocalkvError(f"cannot read --tools {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise LocalkvError(f"cannot read --tools {path}: not JSON ({e})") from None
    raw = data.get("tools") if isinstance(data, dict) else data
    try:
        tools = read_tools(raw)
        named = choice not in (None, "auto", "required", "none")
        return tools, read_choice({"type": "function", "function": {"name": choice}} if named else choice, tools)
    except ToolError as e:
        raise LocalkvError(f"--tools {path}: {e}") from None


def print_calls(plan: Plan, text: str) -> bool:
    """The reply's text (if any), then one JSON line per call; whether it made calls."""
    content, calls = plan.parse(text)
    if content.strip():
        sys.stdout.write(content.strip() + "\n")
    for c in calls:
        print(json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False))
    sys.stdout.flush()
    return bool(calls)
