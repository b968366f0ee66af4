"""What one `localkv bench` run was asked for: the engine's settings and the bench's own, the
engines built from them, and the command line that reproduces a suite."""

import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from localkv.config import EngineConfig
from localkv.engine import Engine

_DEFAULT = EngineConfig()


@dataclass(slots=True, frozen=True)
class Options:
    engine: EngineConfig = field(default_factory=EngineConfig)
    vs: str | None = None  # "llama.cpp": llama-cpp-python on the same work, interleaved
    quick: bool = False  # smoke sizes: the same rows and fields, the targets "not measured"
    long: bool = False  # evict: also a long generation per policy
    seed: int = 0
    reps: int | None = None  # None: the suite's default
    n_prompt: int = 512  # speed only
    n_gen: int = 128  # speed only
    depths: tuple[int, ...] = (0,)  # speed only: tokens in the K/V before each test (llama-bench's -d)
    progress: Callable[[str], None] | None = None
    url: str | None = None  # serve: the load against this OpenAI-compatible server instead of localkv's own

    def say(self, msg: str):
        if self.progress:
            self.progress(msg)

    def new_engine(self, **changes) -> Engine:
        """An engine of these settings with `changes`; without the disk cache unless asked, so a
        bench does not write into the user's LOCALKV_HOME (the cache suite's children get their own)."""
        changes = {"disk_cache": False} | changes
        if changes.get("spec", self.engine.spec) != "draft":  # a draft model only where it drafts
            changes["draft_model"] = None
        config = replace(self.engine, **changes)
        return Engine(config, progress=self.progress is not None and sys.stderr.isatty())

    def command(self, suite: str, threads: int | None) -> str:
        """The command line that reproduces this suite, thread count pinned."""
        e = self.engine
        args = ["localkv", "bench", suite] + (["-m", e.model] if e.model else [])
        if suite == "speed" and not self.quick:
            args += ["-p", str(self.n_prompt), "-n", str(self.n_gen), "-r", str(self.reps or 5)]
        if suite == "speed" and self.depths != (0,):
            args += ["-d", ",".join(map(str, self.depths))]
        elif suite in ("fork", "cache", "grammar", "spec") and self.reps:
            args += ["-r", str(self.reps)]
        if threads and suite != "memory":
            args += ["-t", str(threads)]
        if self.vs and suite in ("speed", "fork", "cache", "spec", "kv"):
            args += ["--vs", self.vs]
        args += ["--quick"] * self.quick + ["--long"] * (self.long and suite == "evict")
        args += ["--url", self.url] if self.url and suite == "serve" else []
        args += ["--seed", str(self.seed)] if self.seed else []
        args += ["--block-size", str(e.block_size)] if e.block_size != _DEFAULT.block_size else []
        args += ["--kv-mem", size_flag(e.kv_mem)] if e.kv_mem != _DEFAULT.kv_mem else []
        args += ["--kv-dtype", e.kv_dtype] if e.kv_dtype != _DEFAULT.kv_dtype and suite not in ("memory", "kv") else []
        args += ["--device", e.device] if e.device != _DEFAULT.device and suite != "memory" else []
        args += ["--spec", e.spec] if e.spec != _DEFAULT.spec and suite not in ("memory", "spec") else []
        args += ["--spec-max", str(e.spec_max)] if e.spec_max != _DEFAULT.spec_max and suite != "memory" else []
        args += ["--draft-model", e.draft_model] if e.draft_model and suite in ("serve", "spec") else []
        return shlex.join(args)


def size_flag(n: int) -> str:
    """Bytes as a size flag spells them, exactly: 536870912 -> '512MiB', 1000 -> '1000'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)
