"""What a pull shows on stderr: a line per step, and a rich progress bar for the bytes."""

import sys


def say(progress: bool, msg: str):
    if progress:
        print(msg, file=sys.stderr, flush=True)


def progress_bar(progress: bool):
    """A rich Progress on stderr (bytes, speed), or None when progress is off."""
    if not progress:
        return None
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
