"""`localkv run --tools FILE`: the calls as JSON lines, checked against their schema, on the tiny
random-weight model (its ChatML template has no tools: the generic form); bad tools files and
flags are one error line before any model loads."""

import io
import json
import sys

import jsonschema
import pytest

from localkv.cli import main
from tiny_model import write_gguf

ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": ARGS}}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_gguf(tmp_path_factory.mktemp("cli-tools") / "tiny.gguf", ctx=2048))


def cli(monkeypatch, capsys, *argv):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def tools_file(tmp_path, tools=TOOLS, wrap=False):
    p = tmp_path / "tools.json"
    p.write_text(json.dumps({"tools": tools} if wrap else tools))
    return str(p)


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_run_prints_each_call_as_a_json_line(tiny, tmp_path, monkeypatch, capsys, choice):
    argv = ["run", "-m", tiny, "--kv-mem", "8MiB", "--no-save", "--temperature", "0", "--max-tokens", "300"]
    files = ["--tools", tools_file(tmp_path, wrap=True), "--tool-choice", choice]
    rc, out, err = cli(monkeypatch, capsys, *argv, *files, "Weather in Paris?")
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert lines
    for line in lines:
        call = json.loads(line)
        assert call["name"] == "get_weather"
        jsonschema.validate(call["arguments"], ARGS)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--tools", "/no/such.json"], "cannot read --tools /no/such.json"),
        (["--tool-choice", "required"], "--tool-choice needs --tools"),
        (["--tools", "BAD_SCHEMA"], "invalid json schema in tools[0].function.parameters"),
        (["--tools", "OK", "--tool-choice", "nope"], "no tool is named 'nope'"),
        (["--tools", "OK", "--format", "json"], "do not go together"),
        (["--tools", "OK", "--raw"], "does not go with --raw"),
    ],
)
def test_bad_tools_are_one_error_line(tiny, tmp_path, monkeypatch, capsys, argv, needle):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}]
    files = {"OK": tools_file(tmp_path), "BAD_SCHEMA": str(tmp_path / "bad.json")}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    argv = [files.get(a, a) for a in argv]
    rc, out, err = cli(monkeypatch, capsys, "run", "-m", tiny, "--no-save", *argv, "hi")
    assert rc != 0 and needle in err and len(err.strip().splitlines()) == 1, err
