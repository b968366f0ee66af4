"""`localkv bench grammar`: decode with and without a JSON schema's mask, side by side."""

import pytest

from localkv.bench import grammar_cost
from localkv.bench import report as br
from localkv.bench.options import Options
from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.grammar import Grammar
from localkv.sampling import Constraint
from tiny_model import write_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("bench-grammar") / "tiny.gguf", ctx=512)


def test_grammar_quick(tiny):
    rep = grammar_cost.run(Options(engine=EngineConfig(model=str(tiny), threads=1), quick=True, reps=2))
    free, masked = rep.rows
    assert (free["variant"], masked["variant"]) == ("unconstrained", "JSON schema")
    assert all(
        r["tokens"] == grammar_cost.QUICK_TOKENS and r["decode_tps"] > 0 and r["sample_ms"] > 0 for r in rep.rows
    )
    assert rep.summary["mask_cost"].endswith("%") and rep.summary["reps"] == 2
    (target,) = rep.targets
    assert target.ok is None  # smoke sizes, and not SmolLM2: not the target's workload
    assert rep.command == f"localkv bench grammar -m {tiny} -r 2 -t 1 --quick"
    assert "| JSON schema" in br.format_md(rep)


def test_every_masked_step_runs_under_the_grammar(tiny):
    """The timed loop restarts a completed grammar, so all of its steps pay for a mask."""
    eng = Engine(EngineConfig(model=str(tiny), threads=1, prefix_cache=False))
    g = Grammar.compile(Constraint("grammar", 'start: "a"\n'), eng.tokenizer)
    calls = []
    fwd, smp = grammar_cost.decode(eng, [5, 6, 7], 9, 0, _Counting(g, calls))
    assert len(fwd) == len(smp) == 9 and len(calls) == 9


class _Counting:
    """A grammar whose matchers count their masks."""

    def __init__(self, g, calls):
        self.g, self.calls = g, calls

    def matcher(self):
        m = self.g.matcher()
        calls = self.calls

        class M:
            def allowed(self):
                calls.append(1)
                return m.allowed()

            def accept(self, t):
                m.accept(t)

        return M()
