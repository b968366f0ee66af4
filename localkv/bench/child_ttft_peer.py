"""The cache suite's timed llama.cpp process: `python -m localkv.bench.child_ttft_peer` with a
JSON request on stdin ({"model", "n_ctx", "threads", "ids", "cache_dir" (null: no cache),
"capacity"}). Times the first token of a greedy completion of ids in this fresh process, through
create_completion: with LlamaDiskCache set, that call looks up the longest cached prefix,
load_state()s it and evaluates the rest. Prints one JSON line, as child_ttft.py does for localkv."""

import json
import sys
import time


def main():
    t_start = time.perf_counter()
    a = json.loads(sys.stdin.read())
    from localkv.bench.peer import drop_own_env

    drop_own_env()  # llama.cpp runs as the user's environment says, not with localkv's spin settings
    import llama_cpp  # after the clock starts: its load counts as model load, as localkv's imports do

    llm = llama_cpp.Llama(
        model_path=a["model"],
        n_ctx=a["n_ctx"],
        n_threads=a["threads"],
        n_threads_batch=a["threads"],
        n_batch=512,
        n_ubatch=512,
        verbose=False,
    )
    cached = 0
    if a["cache_dir"]:
        llm.set_cache(llama_cpp.LlamaDiskCache(cache_dir=a["cache_dir"], capacity_bytes=a["capacity"]))
        key = llm.cache._find_longest_prefix_key(tuple(a["ids"]))  # what the call below will load
        cached = llama_cpp.Llama.longest_token_prefix(key, a["ids"]) if key else 0
    load_s = time.perf_counter() - t_start
    t0 = time.perf_counter()
    it = llm.create_completion(a["ids"], max_tokens=a.get("max_tokens", 1), temperature=0.0, stream=True)
    first = next(it)
    ttft = time.perf_counter() - t0
    for _ in it:  # the rest; with a cache the state is saved after the last token
        pass
    out = {
        "engine": "llama.cpp",
        "ttft_s": ttft,
        "load_s": load_s,
        "request_s": time.perf_counter() - t0,
        "prompt_tokens": len(a["ids"]),
        "cached_tokens": cached,
        "first": first["choices"][0]["text"],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
