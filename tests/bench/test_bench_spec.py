"""`localkv bench spec --quick` on a tiny model: every task runs with and without speculation,
the texts agree, and the report has the issue's rows. Speed is never asserted."""

import pytest
from test_bench_suites import _check_report

from localkv.bench import spec
from localkv.bench.options import Options
from localkv.config import EngineConfig
from tiny_model import write_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("bench-spec") / "tiny.gguf", ctx=4096)


def test_the_tasks_are_data_with_the_issues_five():
    tasks = spec.load_tasks()
    assert [t["name"] for t in tasks] == ["a", "b", "c", "d", "e"]
    assert [t["role"] for t in tasks[3]["turn"]] == ["user", "assistant", "user"]


def test_spec_quick(tiny):
    rep = spec.run(Options(engine=EngineConfig(model=str(tiny), threads=1), quick=True))
    _check_report(rep, "spec")
    assert [r["task"] for r in rep.rows] == ["a", "b", "c", "d", "e"]
    assert all(r["identical"] == "yes" and r["off_tps"] > 0 and r["ngram_tps"] > 0 for r in rep.rows)
    assert sum(r["drafted"] for r in rep.rows) > 0
    verdicts = {t.name: t.ok for t in rep.targets}
    assert verdicts["text with vs without speculation, all tasks"] is True
    assert verdicts["task a decode vs --spec off"] is None  # speed is judged on SmolLM2 at full size only


def test_each_measured_run_drafts_from_its_own_text_only(tiny, monkeypatch):
    """The engine's shared n-grams are empty as each measured run starts: the rep before wrote
    the same greedy reply, which it would otherwise draft as a copy."""
    from localkv.spec.control import pool_of

    filled = []

    class Watched(spec.Generation):
        def run(self):
            filled.append(bool(pool_of(self.engine)._key.any()))
            return super().run()

    monkeypatch.setattr(spec, "Generation", Watched)
    o = Options(engine=EngineConfig(model=str(tiny), threads=1), quick=True, reps=2)
    spec.run(o)
    warmups = 2  # one per engine, before the reps: --spec ngram's records its text
    assert len(filled) == warmups + 2 * 5 * 2 and not any(filled[warmups:])


def test_speculation_flags_reach_the_serve_suite_and_its_command(monkeypatch):
    """`localkv bench serve --spec ngram`: the server under test speculates, and the command
    that reproduces the suite says so (bench spec runs both sides itself: no --spec there)."""
    from localkv.bench import serve

    o = Options(engine=EngineConfig(spec="ngram", spec_max=4), quick=True)
    assert "--spec ngram --spec-max 4" in o.command("serve", 2)
    assert "--spec ngram" not in o.command("spec", 2) and "--spec-max 4" in o.command("spec", 2)
    seen = []

    def server(path, threads, kv_mem, home, extra=()):
        seen.append(extra)
        raise RuntimeError("stop here")

    monkeypatch.setattr(serve, "localkv_server", server)
    with pytest.raises(RuntimeError, match="stop here"):
        serve._localkv(o, "model.gguf", 1, [], concurrent=True, kv_dtype="f16")
    assert seen == [("--kv-dtype", "f16", "--spec", "ngram", "--spec-max", "4")]


def test_spec_quick_with_a_draft_model(tiny):
    """--draft-model: --spec draft runs beside prompt lookup, its columns filled, the same text;
    the command that reproduces the suite names the draft model."""
    o = Options(engine=EngineConfig(model=str(tiny), threads=1, spec="draft", draft_model=str(tiny)), quick=True)
    rep = spec.run(o)
    assert all(r["identical"] == "yes" and r["draft_tps"] > 0 for r in rep.rows)
    assert sum(r["draft_accepted"] for r in rep.rows) == sum(r["draft_drafted"] for r in rep.rows) > 0  # itself
    assert "draft_speedup" in [c.key for c in rep.columns] and f"--draft-model {tiny}" in rep.command
