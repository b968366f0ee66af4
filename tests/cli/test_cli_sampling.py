"""The sampling flags of issue 19 through the CLI, on a tiny random-weight model: catalog defaults
under the flags, stop strings, --logprobs, --schema/--grammar/--format, --ctx, the prefill bar,
--version and shell completion."""

import dataclasses
import hashlib
import io
import json
import shutil
import sys
from pathlib import Path

import jsonschema
import pytest

import localkv.progress
from localkv.cli import main
from localkv.conversations.store import ConversationStore
from localkv.hub import catalog as registry
from localkv.hub.catalog import CatalogEntry, sampling_for
from localkv.sampling import SamplingParams
from tiny_model import write_gguf

SCHEMA = {
    "type": "object",
    "properties": {"w": {"type": "string", "maxLength": 5}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["w", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_gguf(tmp_path_factory.mktemp("cli-sampling") / "tiny.gguf", ctx=1024))


def cli(monkeypatch, capsys, *argv):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def run(tiny, *extra):
    return ["run", "-m", tiny, "--kv-mem", "8MiB", "--no-save", *extra]


def test_help_says_which_defaults_come_from_the_model(monkeypatch, capsys):
    rc, out, _ = cli(monkeypatch, capsys, "run", "--help")
    flat = " ".join(out.split())
    assert rc == 0 and "[default: model default (see `localkv show`), else 0.8]" in flat
    for flag in (
        "--min-p",
        "--repeat-penalty",
        "--repeat-last-n",
        "--presence-penalty",
        "--frequency-penalty",
        "--dry-multiplier",
        "--dry-base",
        "--dry-allowed-length",
        "--dry-penalty-last-n",
    ):
        assert flag in out
    assert all(f in out for f in ("--stop", "--logprobs", "--schema", "--grammar", "--format", "--ctx"))


@pytest.fixture
def catalogued(tiny, private_home, monkeypatch):
    """The tiny model as a pulled catalog model whose card says temperature 0.3, min-p 0.1."""
    (private_home / "models").mkdir(parents=True)
    path = shutil.copy(tiny, private_home / "models" / "tiny.gguf")
    data = Path(tiny).read_bytes()
    e = CatalogEntry("tiny", "tiny.gguf", len(data), hashlib.sha256(data).hexdigest(), "x", "0", "tiny.gguf")
    e = dataclasses.replace(e, sampling={"temperature": 0.3, "min_p": 0.1})
    monkeypatch.setattr(registry, "catalog", lambda: {e.name: e})
    return path


def test_model_defaults_sit_between_samplingparams_and_the_flags(catalogued):
    assert sampling_for("tiny") == SamplingParams(temperature=0.3, min_p=0.1)
    assert sampling_for(str(catalogued), {"temperature": 0.9, "top_k": None}).temperature == 0.9  # by file
    assert sampling_for("/elsewhere/model.gguf", {}) == SamplingParams()


def test_run_records_the_model_defaults_and_the_flags(catalogued, private_home, monkeypatch, capsys):
    rc, _, err = cli(monkeypatch, capsys, "run", "-m", "tiny", "--kv-mem", "8MiB", "-n", "2", "--top-k", "5", "hi")
    assert (rc, err) == (0, "")
    with ConversationStore(private_home / "conversations.db") as s:
        reply = s.latest_leaf(s.latest_conversation())
    assert reply.sampling["temperature"] == 0.3 and reply.sampling["min_p"] == 0.1 and reply.sampling["top_k"] == 5


def test_dry_flags_reach_the_sampling_params(tiny, private_home, monkeypatch, capsys):
    dry = ["--dry-multiplier", "0.8", "--dry-base", "2", "--dry-allowed-length", "3", "--dry-penalty-last-n", "256"]
    rc, _, err = cli(monkeypatch, capsys, "run", "-m", tiny, "--kv-mem", "8MiB", "-n", "8", "-t", "0", *dry, "hi")
    assert (rc, err) == (0, "")
    with ConversationStore(private_home / "conversations.db") as s:
        got = s.latest_leaf(s.latest_conversation()).sampling
    assert {k: got[k] for k in ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n")} == {
        "dry_multiplier": 0.8,
        "dry_base": 2.0,
        "dry_allowed_length": 3,
        "dry_penalty_last_n": 256,
    }


def test_logprobs_in_run_json(tiny, monkeypatch, capsys):
    rc, out, _ = cli(monkeypatch, capsys, *run(tiny, "-n", "6", "--json", "--logprobs", "3", "--seed", "1", "hi"))
    r = json.loads(out)
    assert rc == 0 and len(r["logprobs"]) == r["completion_tokens"]
    for t in r["logprobs"]:
        assert len(t["top"]) == 3 and t["logprob"] <= 0 and {"token", "id", "logprob", "top"} <= t.keys()
        assert [x["logprob"] for x in t["top"]] == sorted((x["logprob"] for x in t["top"]), reverse=True)


def test_stop_string_through_the_cli(tiny, monkeypatch, capsys):
    args = run(tiny, "-n", "30", "-t", "0", "--ignore-eos", "--json", "tell me")
    free = json.loads(cli(monkeypatch, capsys, *args)[1])["text"]
    at = next(i for i in range(4, len(free) - 2) if "\ufffd" not in free[i : i + 2])
    rc, out, _ = cli(monkeypatch, capsys, *args, "--stop", free[at : at + 2], "--stop", "\x01never")
    r = json.loads(out)
    assert rc == 0 and r["text"] == free[: free.index(free[at : at + 2])] and r["finish_reason"] == "stop"


def test_schema_constrains_every_branch_of_a_fork(tiny, tmp_path, monkeypatch, capsys):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    args = ["fork", "-m", tiny, "--kv-mem", "8MiB", "--no-save", "-b", "3", "-t", "6", "--seed", "2", "-n", "120"]
    rc, out, err = cli(monkeypatch, capsys, *args, "--json", "--schema", str(schema), "a person")
    assert (rc, err) == (0, "")
    for b in json.loads(out)["branches"]:
        x = json.loads(b["text"])
        assert set(x) == {"w", "n"} and len(x["w"]) <= 5 and 0 <= x["n"] <= 9


@pytest.mark.parametrize("kind", ["lark", "gbnf"])
def test_grammar_file(tiny, tmp_path, monkeypatch, capsys, kind):
    g = tmp_path / "g.txt"
    g.write_text('start: "yes" | "no"\n' if kind == "lark" else 'root ::= "yes" | "no"\n')
    rc, out, _ = cli(monkeypatch, capsys, *run(tiny, "-t", "3", "--grammar", str(g), "--json", "ok?"))
    assert rc == 0 and json.loads(out)["text"] in ("yes", "no")


def test_format_json(tiny, monkeypatch, capsys):
    rc, out, _ = cli(monkeypatch, capsys, *run(tiny, "-t", "0.5", "-n", "300", "--format", "json", "--json", "x"))
    r = json.loads(out)
    assert rc == 0 and r["finish_reason"] == "stop" and isinstance(json.loads(r["text"]), dict)


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--format", "yaml"], "unknown --format 'yaml'"),
        (["--format", "json", "--grammar", "g"], "--format and --grammar do not go together"),
        (["--schema", "/no/such.json"], "cannot read --schema /no/such.json"),
        (["--grammar", "BAD"], "invalid grammar in"),
        (["--min-p", "2"], "invalid min-p"),
        (["--repeat-penalty", "-1"], "invalid repeat penalty"),
        (["--dry-multiplier", "-0.5"], "invalid DRY multiplier -0.5"),
        (["--dry-base", "0.9"], "invalid DRY base 0.9"),
        (["--dry-allowed-length", "-1"], "invalid DRY allowed length -1"),
        (["--dry-penalty-last-n", "-2"], "invalid DRY penalty-last-n -2"),
        (["--logprobs", "99"], "invalid logprobs 99"),
        (["--stop", ""], "invalid stop string"),
        (["--ctx", "1"], "invalid --ctx 1"),
    ],
)
def test_bad_sampling_flags_fail_in_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys, extra, needle):
    bad = tmp_path / "bad.gbnf"
    bad.write_text("root ::= (")
    extra = [str(bad) if x == "BAD" else x for x in extra]
    rc, out, err = cli(monkeypatch, capsys, "run", "-m", str(tmp_path / "absent.gguf"), *extra, "hi")
    assert rc == 1 and out == "" and needle in err and len(err.splitlines()) == 1  # not "unknown model"


def test_ctx_is_reported(tiny, monkeypatch, capsys):
    rc, out, err = cli(monkeypatch, capsys, *run(tiny, "-n", "2", "--ctx", "300", "--json", "-v", "hi"))
    assert rc == 0 and json.loads(out)["ctx"] == 300 and "context:              300 tokens" in err
    rc, _, err = cli(monkeypatch, capsys, *run(tiny, "--ctx", "1000", "--kv-mem", "128KiB", "hi"))
    assert rc == 1 and "--ctx 1000 needs" in err and "raise --kv-mem or lower --ctx" in err


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_prefill_bar_only_on_a_terminal(tiny, monkeypatch, capsys, terminal):
    monkeypatch.setattr(localkv.progress, "SHOW_AFTER_S", -1.0)  # every prefill counts as long
    err = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(run(tiny, "-n", "1", "--raw", "ab " * 200)) == 0  # 600 byte tokens: two prefill chunks
    shown = err.getvalue()
    if terminal:
        assert "\r\x1b[2K[####################....] prefill 512/600 tokens · " in shown  # the first chunk
        assert shown.endswith("\r\x1b[2K")  # erased before the reply
    else:
        assert shown == ""


def test_version_and_completion(monkeypatch, capsys):
    rc, out, _ = cli(monkeypatch, capsys, "--version")
    assert rc == 0 and out.startswith("localkv ") and out.strip() != "localkv"
    with pytest.raises(SystemExit) as e:  # Typer prints the script and exits, as in a shell
        main(["--show-completion", "bash"])
    assert e.value.code == 0 and "_LOCALKV_COMPLETE=complete_bash" in capsys.readouterr().out


def test_the_bar_waits_for_a_prefill_expected_to_be_long():
    from localkv.cli.prefill_bar import PrefillBar
    from localkv.progress import PrefillProgress

    out = Terminal()
    bar = PrefillBar(out)
    bar(PrefillProgress(done=600, total=1000, cached=100, elapsed_s=1.0))  # 500 t/s: 1.8 s in all
    assert out.getvalue() == ""
    bar(PrefillProgress(done=200, total=1000, cached=100, elapsed_s=0.5))  # 200 t/s: 4.5 s in all
    assert out.getvalue() == "\r\x1b[2K[####....................] prefill 200/1000 tokens · 200 tok/s · 100 cached"
    bar(PrefillProgress(done=1000, total=1000, cached=100, elapsed_s=4.4))
    assert out.getvalue().endswith("\r\x1b[2K") and not bar.shown


# ------------------------------------------------------------------ the real model


def test_the_catalog_gives_smollm2_its_cards_sampling_and_dry():
    p = sampling_for("smollm2-135m")
    assert (p.temperature, p.top_p) == (0.2, 0.9) and p.top_k == SamplingParams().top_k
    assert p.repeat_penalty == 1.0  # a penalty over the prompt's tokens breaks copying and fixing tasks
    assert p.dry_multiplier == 0.8 and "\n" not in p.dry_sequence_breakers  # poems loop across lines
    assert sampling_for("smollm2-135m", {"dry_multiplier": 0.0}).dry_multiplier == 0.0


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.mark.model
def test_smollm2_schema_replies_parse_in_every_branch(real_model_path, tmp_path, monkeypatch, capsys):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    args = ["fork", "-m", str(real_model_path), "--no-save", "-b", "3", "--seed", "4", "-n", "80", "--json"]
    rc, out, err = cli(monkeypatch, capsys, *args, "--schema", str(schema), "Describe a fictional person.")
    assert rc == 0, err
    for b in json.loads(out)["branches"]:
        x = json.loads(b["text"])
        assert set(x) == {"name", "age", "city"} and 0 <= x["age"] <= 120 and b["finish_reason"] == "stop"


# no bounds and no additionalProperties: the numbers' digits, and the other properties', end by
# grammar alone; before they did, 2 of these 10 seeds wrote one id's digits until -n 128 ran out
NUMBERS = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "price": {"type": "number"}},
    "required": ["id", "price"],
}


@pytest.mark.model
def test_smollm2_unbounded_numbers_end_in_every_seed(real_model_path, tmp_path, monkeypatch, capsys):
    schema = tmp_path / "numbers.json"
    schema.write_text(json.dumps(NUMBERS))
    for seed in range(10):
        args = ["run", "-m", str(real_model_path), "--no-save", "--seed", str(seed), "-n", "128", "--json"]
        rc, out, err = cli(
            monkeypatch, capsys, *args, "--schema", str(schema), "Give a random number and a measurement."
        )
        assert rc == 0, err
        r = json.loads(out)
        jsonschema.validate(json.loads(r["text"]), NUMBERS)
        assert r["finish_reason"] == "stop" and r["completion_tokens"] < 128, (seed, r["text"])
