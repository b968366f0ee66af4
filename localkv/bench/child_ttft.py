"""The cache suite's timed process: `python -m localkv.bench.child_ttft` with a JSON request on
stdin ({"config": EngineConfig.to_dict(), "ids": [...]}). Builds an engine in this fresh process
and answers one greedy token on the path `localkv run` takes; prints one JSON line with the
engine load time and the request's time to first token, as `localkv run -v` defines it."""

import json
import sys
import time


def main():
    t_start = time.perf_counter()
    req = json.loads(sys.stdin.read())
    # imported after the clock starts: the engine's code loading counts as model load, as
    # llama_cpp's does in child_ttft_peer.py
    from localkv.config import EngineConfig
    from localkv.engine import Engine
    from localkv.generation import Generation
    from localkv.sampling import SamplingParams

    eng = Engine(EngineConfig.from_dict(req["config"]))
    load_s = time.perf_counter() - t_start
    t0 = time.perf_counter()
    r = Generation(eng, req["ids"], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)).run()
    out = {
        "engine": "localkv",
        "ttft_s": r.ttft_s,
        "load_s": load_s,
        "request_s": time.perf_counter() - t0,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "first": r.text,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
