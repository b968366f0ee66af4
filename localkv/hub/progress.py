"""What a pull shows on stderr: a line per step, and a rich progress bar for the bytes (its own,
or drawn for huggingface_hub's downloads through the tqdm class they take)."""

import sys
import warnings


def say(progress: bool, msg: str):
    if progress:
        print(msg, file=sys.stderr, flush=True)


def _columns():
    from rich.progress import BarColumn, DownloadColumn, TextColumn, TransferSpeedColumn

    return (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())


def progress_bar(progress: bool):
    """A rich Progress on stderr (bytes, speed), or None when progress is off."""
    if not progress:
        return None
    from rich.console import Console
    from rich.progress import Progress

    return Progress(*_columns(), console=Console(stderr=True), transient=True)


def download_bar(progress: bool) -> type:
    """A tqdm class for huggingface_hub's tqdm_class: the same rich bar on stderr, or none at all
    (huggingface_hub's own bar would follow its settings, not the caller's progress flag)."""
    from tqdm import tqdm
    from tqdm.rich import tqdm_rich

    class Quiet(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            super().__init__(*args, **(kwargs | {"disable": True}))

    class Rich(tqdm_rich):
        def __init__(self, *args, **kwargs):
            from rich.console import Console
            from tqdm import TqdmExperimentalWarning

            kwargs.pop("name", None)
            kwargs |= {"progress": _columns(), "options": {"console": Console(stderr=True), "transient": True}}
            with warnings.catch_warnings():  # tqdm calls its rich bar experimental; localkv draws only bytes
                warnings.simplefilter("ignore", TqdmExperimentalWarning)
                super().__init__(*args, **kwargs)

    return Rich if progress else Quiet
