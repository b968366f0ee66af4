"""The text the bench feeds the model: the GPL-3.0 license, shipped verbatim in localkv/bench/data,
so every machine measures the same tokens."""

from pathlib import Path

TEXT = Path(__file__).parent / "data" / "gpl-3.0.txt"


def text_tokens(engine, n: int) -> list[int]:
    """The first n tokens of the text (fewer if it is shorter)."""
    return engine.tokenizer.encode(TEXT.read_text())[:n]


def text_ids(engine, n: int) -> list[int]:
    """Exactly n tokens: the text's, repeated if it is short."""
    ids = text_tokens(engine, 1 << 30)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]
