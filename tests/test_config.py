"""EngineConfig: one place for the engine's defaults and checks; the CLI options built from it."""

from dataclasses import FrozenInstanceError, replace

import pytest
from typer.testing import CliRunner

from localkv.cli import app
from localkv.cli.options import ENGINE_OPTIONS, SAMPLING_OPTIONS, engine_config
from localkv.config import EngineConfig
from localkv.errors import LocalkvError
from localkv.kv.evict import EvictConfig
from localkv.spec.control import COMMANDS_DEFAULT
from localkv.units import format_size, parse_size


def test_sizes_are_parsed_once_and_kept_in_bytes():
    cfg = EngineConfig(kv_mem="512MiB", disk_cache_size="1G")
    assert cfg.kv_mem == 512 << 20 and cfg.disk_cache_size == 1 << 30
    assert replace(cfg, block_size=8).kv_mem == 512 << 20


def test_config_is_frozen():
    with pytest.raises(FrozenInstanceError):
        EngineConfig().block_size = 8


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(block_size=12), "power of two"),
        (dict(block_size=0), "power of two"),
        (dict(prefill_chunk=0), "prefill chunk"),
        (dict(threads=0), "thread count"),
        (dict(device="tpu"), "unknown device"),
        (dict(kv_mem=0), "kv-mem"),
        (dict(evict=EvictConfig(policy="lru", budget=64)), "unknown KV policy"),
        (dict(evict=EvictConfig(policy="sliding")), "needs a budget"),
    ],
)
def test_validate_names_the_bad_value(kw, msg):
    with pytest.raises(LocalkvError, match=msg):
        EngineConfig(**kw).validate()


def test_bad_size_fails_when_made():
    with pytest.raises(LocalkvError, match="invalid size"):
        EngineConfig(kv_mem="lots")


def test_dict_round_trip_keeps_every_field():
    cfg = EngineConfig(model="m.gguf", threads=2, block_size=8, evict=EvictConfig(policy="h2o", budget=256))
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg


def test_option_defaults_come_from_the_dataclasses():
    """The dataclasses' defaults, but the commands speculate where the library does not."""
    assert engine_config({}) == EngineConfig(spec=COMMANDS_DEFAULT).validate()
    assert EngineConfig().spec == "off" and COMMANDS_DEFAULT == "ngram"
    assert engine_config({"draft_model": "x.gguf"}).spec == "draft"
    cfg = engine_config({"no_cache": True, "evict": "sliding", "kv_budget": 256, "sinks": 16})
    assert not cfg.prefix_cache and cfg.evict == EvictConfig(policy="sliding", budget=256, sinks=16)


@pytest.mark.parametrize("command", ["run", "fork", "chat"])
def test_every_engine_command_takes_every_engine_option(command):
    text = CliRunner().invoke(app, [command, "--help"], terminal_width=200).output
    for _, _, flags, _ in list(ENGINE_OPTIONS.values()) + list(SAMPLING_OPTIONS.values()):
        for flag in flags[-1].split("/"):  # a switch: --think/--no-think shows both names
            assert flag in text, f"{command} lacks {flag}"


def test_fork_defaults_to_shorter_replies():
    text = CliRunner().invoke(app, ["fork", "--help"], terminal_width=200).output
    line = next(x for x in text.splitlines() if "--max-tokens" in x)
    assert "256" in line


def test_sizes_for_people():
    assert format_size(512) == "512 B" and format_size(94 << 20) == "94.0 MiB" and format_size(3 << 30) == "3.0 GiB"
    assert parse_size("512MiB") == 512 << 20 and parse_size("2G") == 2 << 30 and parse_size("100") == 100


@pytest.mark.parametrize(
    "given, kv_dtype",
    [
        ({"cache_type_k": "q8_0"}, "q8_0:f16"),  # llama.cpp's default f16 for the half not given
        ({"cache_type_k": "q8_0", "cache_type_v": "Q8_0"}, "q8_0"),
        ({"kv_dtype": "q8_0", "cache_type_v": "q4_0"}, "q8_0:q4_0"),
        ({"kv_dtype": "q4_0:q8_0", "cache_type_k": "f16"}, "f16:q8_0"),
        ({"kv_dtype": "q4_0"}, "q4_0"),
    ],
)
def test_ctk_and_ctv_set_the_halves_of_kv_dtype(given, kv_dtype):
    assert engine_config(given).kv_dtype == kv_dtype


@pytest.mark.parametrize("command", ["run", "fork", "chat", "serve", "bench"])
def test_ctk_and_ctv_are_options_of_every_command_with_kv_dtype(command, capsys):
    """Parsed as options (a bad value is its own one-line error), and combined before the engine's
    other checks (--device tpu fails after them, so -ctk was taken)."""
    from localkv.cli import main

    args = ["hi"] if command in ("run", "fork") else []
    assert main([command, "-ctk", "q4", *args]) != 0
    assert capsys.readouterr().err.strip() == "error: unknown -ctk 'q4': use one of f32, f16, q8_0, q4_0"
    assert main([command, "-ctk", "q8_0", "-ctv", "q4_0", "--device", "tpu", *args]) != 0
    err = capsys.readouterr().err.strip()
    assert "unknown device" in err and "\n" not in err
