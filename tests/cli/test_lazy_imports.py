"""Every `localkv` command loads the CLI package; the front ends it does not run stay unloaded
(docs/ARCHITECTURE.md: front ends import their neighbours inside the commands that need them)."""

import subprocess
import sys

NEIGHBOURS = ("localkv.bench", "localkv.serve", "localkv.tui", "textual", "uvicorn", "starlette")


def test_the_cli_package_loads_no_other_front_end():
    code = f"import sys, localkv.cli\nprint(' '.join(m for m in sys.modules if m.startswith({NEIGHBOURS!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == []
