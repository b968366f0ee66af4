"""`localkv bench speed`'s table: llama-bench's markdown layout, with the bandwidth columns and,
beside llama.cpp, an engine column and the ratio."""


def _size(b: int) -> str:  # llama-bench's units, two decimals
    return f"{b / 2**20:.2f} MiB" if b < 2**30 else f"{b / 2**30:.2f} GiB"


def _params(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n < 1e9 else f"{n / 1e9:.2f} B"


def format_speed_table(rows: list[dict], ratios: dict[str, float] | None = None) -> str:
    """llama-bench's markdown table; when llama.cpp rows are present an engine column leads and
    a ratio column (localkv t/s / llama.cpp t/s) ends each localkv row."""
    compared = any(r["engine"] != "localkv" for r in rows)
    ratios = ratios or {}
    cols = ["model", "size", "params", "backend", "threads", "test", "t/s"]
    cols += ["GB/s"] * any("gbps" in r for r in rows) + ["of read probe"] * any("probe_share" in r for r in rows)
    if compared:
        cols = ["engine", *cols, "vs llama.cpp"]
    left = {"engine", "model", "backend"}  # llama-bench left-aligns text, right-aligns numbers
    table = [cols] + [[_cell(r, c, ratios) for c in cols] for r in rows]
    w = [max(len(row[i]) for row in table) for i in range(len(cols))]

    def fmt(row):
        return "| " + " | ".join(v.ljust(n) if c in left else v.rjust(n) for c, v, n in zip(cols, row, w)) + " |"

    rule = "| " + " | ".join("-" * n if c in left else "-" * (n - 1) + ":" for c, n in zip(cols, w)) + " |"
    return "\n".join([fmt(table[0]), rule] + [fmt(r) for r in table[1:]]) + "\n"


def _cell(r: dict, col: str, ratios: dict[str, float]) -> str:
    match col:
        case "engine":
            return r["engine"]
        case "model":
            return r["model_type"]
        case "size":
            return _size(r["model_size"])
        case "params":
            return _params(r["model_n_params"])
        case "backend":
            return r["backend"]
        case "threads":
            return str(r["n_threads"])
        case "test":
            return r["test"]
        case "t/s":
            return f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}"
        case "GB/s":
            return f"{r['gbps']:.2f}" if "gbps" in r else ""
        case "of read probe":
            return f"{r['probe_share'] * 100:.0f}%" if "probe_share" in r else ""
        case "vs llama.cpp":
            x = ratios.get(r["test"]) if r["engine"] == "localkv" else None
            return f"{x:.2f}x" if x is not None else ""
