"""Odd input and odd terminals, through the CLI's funnel: bytes that are not UTF-8 on stdin or in
arguments, closed or full standard streams, extreme sampling values, a LOCALKV_HOME that is not a
folder, and temporaries left by writers that died."""

import io
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import typer

import localkv.cli
from localkv.cli import main
from localkv.conversations.store import ConversationStore
from localkv.home import STALE_AGE
from localkv.hub import pull as pull_mod
from localkv.sampling import Sampler, SamplingParams
from tiny_model import write_gguf

ROOT = Path(__file__).resolve().parents[2]
REPLACED = "undecodable bytes were replaced with U+FFFD"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_gguf(tmp_path_factory.mktemp("hardening") / "tiny.gguf", ctx=1024))


def cli(monkeypatch, capsys, *argv, stdin: bytes | None = b""):
    """main(argv) in this process with stdin holding these bytes (None: stdin closed)."""
    monkeypatch.setattr(sys, "stdin", None if stdin is None else io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def run_args(tiny, *extra):
    return ["run", *extra, "-m", tiny, "-n", "2", "-t", "0", "--kv-mem", "4MiB", "--json"]


def saved_prompts(home) -> list[str]:
    with ConversationStore(home / "conversations.db") as s:
        cid = s.latest_conversation()
        return [] if cid is None else [m.content for m in s.path(s.latest_leaf(cid).id) if m.role == "user"]


def subprocess_cli(*args, home, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT), LOCALKV_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "localkv", *args], env=env, timeout=300, **kw)


# ------------------------------------------------------------------ bytes that are not UTF-8


def test_latin1_stdin_is_replaced_with_one_warning(tiny, monkeypatch, capsys, private_home):
    rc, out, err = cli(monkeypatch, capsys, *run_args(tiny), stdin="café au lait".encode("latin-1"))
    assert rc == 0, err
    assert err.splitlines() == [f"warning: stdin is not valid UTF-8 (first bad byte at offset 3): {REPLACED}"]
    assert json.loads(out)["completion_tokens"] == 2
    assert saved_prompts(private_home) == ["caf\ufffd au lait"]  # the log holds what the model saw


def test_random_bytes_on_stdin_give_an_answer(tiny, monkeypatch, capsys):
    junk = np.random.default_rng(5).integers(0, 256, 200, dtype=np.uint8).tobytes() + b"\x00\xff\xfe"
    rc, out, err = cli(monkeypatch, capsys, *run_args(tiny, "--no-save"), stdin=junk)
    assert rc == 0, err
    assert len(err.splitlines()) == 1 and REPLACED in err
    assert json.loads(out)["prompt_tokens"] > 100


def test_clean_utf8_stdin_gives_no_warning(tiny, monkeypatch, capsys, private_home):
    rc, out, err = cli(monkeypatch, capsys, *run_args(tiny), "ünïcödé", stdin="naïve €\n".encode())
    assert (rc, err) == (0, "")
    assert saved_prompts(private_home) == ["naïve €\nünïcödé"]


def test_argument_that_is_not_utf8_is_replaced(tiny, monkeypatch, capsys, private_home):
    # Python hands undecodable argv bytes over as lone surrogates (surrogateescape)
    rc, out, err = cli(monkeypatch, capsys, *run_args(tiny, "-s", "be k\udce9nd"), "caf\udce9 ol\udcc3")
    assert rc == 0, err
    assert err.splitlines() == [f"warning: arguments 'be k\\xe9nd', 'caf\\xe9 ol\\xc3' are not valid UTF-8: {REPLACED}"]
    assert saved_prompts(private_home) == ["caf\ufffd ol\ufffd"]
    with ConversationStore(private_home / "conversations.db") as s:
        assert s.path(s.latest_leaf(s.latest_conversation()).id)[0].content == "be k\ufffdnd"


def test_file_name_that_is_not_utf8_is_kept(tiny, tmp_path, monkeypatch, capsys):
    # a path may hold any bytes on POSIX: an argument naming an existing file is passed on as is
    odd = os.fsdecode(bytes(tmp_path) + b"/mod\xe8le.gguf")
    os.link(tiny, odd)
    rc, out, err = cli(monkeypatch, capsys, "run", "hi", "-m", odd, "-n", "1", "--kv-mem", "4MiB", "--no-save")
    assert (rc, err) == (0, "")


# ------------------------------------------------------------------ closed and full streams


def test_closed_stdin_reads_as_empty(tiny, monkeypatch, capsys):
    rc, out, err = cli(monkeypatch, capsys, *run_args(tiny, "--no-save"), "hi", stdin=None)
    assert rc == 0 and err == "" and json.loads(out)["completion_tokens"] == 2
    rc, out, err = cli(monkeypatch, capsys, *run_args(tiny, "--no-save"), stdin=None)
    assert (rc, out) == (1, "") and err == "error: empty prompt: pass PROMPT or pipe text on stdin\n"
    rc, out, err = cli(monkeypatch, capsys, "chat", "-m", tiny, stdin=None)
    assert (rc, out) == (1, "") and err == "error: `localkv chat` needs a terminal; use `localkv run` with pipes\n"


def test_closed_stdin_for_real(tiny, tmp_path):
    # `localkv run hi <&-`: file descriptor 0 closed, not merely empty
    args = run_args(tiny, "--no-save")
    p = subprocess_cli(*args, "hi", home=tmp_path, capture_output=True, text=True, preexec_fn=lambda: os.close(0))
    assert p.returncode == 0, p.stderr
    assert p.stderr == "" and json.loads(p.stdout)["completion_tokens"] == 2


def test_full_stdout_is_one_line_and_saves_nothing(tiny, tmp_path):
    with open("/dev/full", "w") as full:
        p = subprocess_cli(
            "run", "hi", "-m", tiny, "-n", "4", "-t", "0", "--kv-mem", "4MiB",
            home=tmp_path, stdin=subprocess.DEVNULL, stdout=full, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    assert p.returncode == 1
    assert p.stderr == "error: cannot write output (No space left on device)\n"
    assert saved_prompts(tmp_path) == [], "an exchange the user never saw is not logged"


def test_closed_stdout_and_broken_pipe(tmp_path):
    p = subprocess_cli(
        "cache", "stats", home=tmp_path, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    assert (p.returncode, p.stderr) == (1, "error: cannot write output (stdout is closed)\n")
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first byte: `localkv ... | true`
    p = subprocess_cli("cache", "stats", home=tmp_path, stdin=subprocess.DEVNULL, stdout=w, stderr=subprocess.PIPE)
    os.close(w)
    assert (p.returncode, p.stderr) == (0, b""), "a closed pipe ends quietly, as `head` expects"


# ------------------------------------------------------------------ odd values


@pytest.mark.parametrize("t", [5e-324, 1e-310, 1e-300, 1e-30, 1e-3, 1.0, 1e30, 1e300, 1.7e308])
@pytest.mark.parametrize("top_k", [0, 40])
def test_any_positive_temperature_gives_a_valid_distribution(t, top_k):
    logits = np.random.default_rng(1).standard_normal(5000).astype(np.float32) * 8
    logits[[7, 4000]] = logits.max() + 1  # a tie at the top
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow or invalid-value warnings on stderr
        s = Sampler(SamplingParams(temperature=t, top_k=top_k, top_p=0.9, seed=3))
        picks = {s(logits) for _ in range(20)}
    assert all(0 <= i < logits.size for i in picks)
    if t < 1e-30:  # tiny temperatures act as greedy (ties stay ties)
        assert picks <= {7, 4000}


def test_subnormal_temperature_runs_as_greedy(tiny, monkeypatch, capsys):
    texts = []
    for t in ("0", "1e-310"):
        rc, out, err = cli(monkeypatch, capsys, *run_args(tiny, "--no-save"), "-t", t, "-n", "6", "hi")
        assert (rc, err) == (0, "")
        texts.append(json.loads(out)["text"])
    assert texts[0] == texts[1]


@pytest.mark.parametrize("flag,value,needle", [("-t", "inf", "invalid temperature inf"), ("--top-p", "nan", "top-p")])
def test_non_finite_sampling_values_are_refused(tiny, monkeypatch, capsys, flag, value, needle):
    rc, out, err = cli(monkeypatch, capsys, *run_args(tiny, "--no-save"), flag, value, "hi")
    assert rc == 1 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and needle in err


# ------------------------------------------------------------------ LOCALKV_HOME


@pytest.mark.parametrize("command", [["cache", "stats"], ["log"], ["models"], "run"])
def test_localkv_home_that_is_a_file(tiny, tmp_path, monkeypatch, capsys, command):
    f = tmp_path / "afile"
    f.write_text("not a folder")
    monkeypatch.setenv("LOCALKV_HOME", str(f))
    argv = run_args(tiny, "hi") if command == "run" else command
    rc, out, err = cli(monkeypatch, capsys, *argv)
    assert (rc, out) == (1, "")
    assert err == f"error: LOCALKV_HOME {f} is not a folder: point LOCALKV_HOME at a folder, or unset it\n"
    assert f.read_text() == "not a folder"


@pytest.mark.parametrize("command", [["log"], "run"])
def test_localkv_home_below_a_file(tiny, tmp_path, monkeypatch, capsys, command):
    home = tmp_path / "afile" / "home"
    (tmp_path / "afile").write_text("not a folder")
    monkeypatch.setenv("LOCALKV_HOME", str(home))
    rc, out, err = cli(monkeypatch, capsys, *(run_args(tiny, "hi") if command == "run" else command))
    assert (rc, out) == (1, "")
    assert err == f"error: cannot create {home}: Not a directory; set LOCALKV_HOME to a writable folder\n"


# ------------------------------------------------------------------ temporaries of dead writers


def test_pull_sweeps_stale_temporaries_only(private_home, monkeypatch):
    models = private_home / "models"
    models.mkdir(parents=True)
    old = os.path.getmtime(models) - STALE_AGE - 60
    made = {}
    for name in (".pull-dead", ".pull-live", ".verify-dead", ".tmp-dead.safetensors", ".tmp-live.safetensors"):
        p = models / name
        if name.endswith(".safetensors"):
            p.write_bytes(b"half a weight cache")
        else:
            p.mkdir()
            (p / "part.whl").write_bytes(b"half a wheel")
        made[name] = p
    (models / "mine.gguf").write_bytes(b"GGUF")
    for name, p in made.items():
        if "dead" in name:
            for q in [*p.glob("*"), p]:
                os.utime(q, (old, old))
    stamp = old + 1
    os.utime(made[".pull-live"], (stamp, stamp))  # an old folder whose download is still being written
    monkeypatch.setattr(pull_mod, "is_pulled", lambda e: True)
    pull_mod.ensure_model("smollm2-135m", progress=False)
    assert sorted(p.name for p in models.iterdir()) == [".pull-live", ".tmp-live.safetensors", "mine.gguf"]


def test_a_commands_exit_code_survives_the_funnel(monkeypatch, capsys):
    small = typer.Typer()

    @small.command()
    def stop():
        print("partial reply")
        raise typer.Exit(130)  # what `run` does when Ctrl-C cut the reply short

    @small.command()
    def other():
        pass

    monkeypatch.setattr(localkv.cli, "app", small)
    assert main(["stop"]) == 130
    assert capsys.readouterr().out == "partial reply\n"
