"""Soak test for `mtp serve` on loopback: many requests with faults mixed in, the server's memory watched.

    python bench/soak.py --requests 200 --concurrency 8 --server-arg=--dtype --server-arg=bfloat16

Every 5th request hangs up after its first token, every 7th is malformed (bad JSON or a prompt longer than the
context); the rest are streamed greedy chat completions. Reported: completed / aborted / refused counts, whether
every well-formed answer arrived complete, and the server's resident memory (RSS) after a warm-up and after every
40 requests: with nothing leaking it stays flat. Bounded (at most 1,000 requests) and loopback only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # run as a script: bench/profile.py would shadow the standard library's profile module

import http.client  # noqa: E402

from mtp.bench.load import PROMPTS, _LocalServer  # noqa: E402


def _rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def _one(port: int, model: str, i: int, max_tokens: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        if i % 7 == 3:
            body = b'{"model": "x", "messages": [' if i % 2 else json.dumps(
                {"model": model, "messages": [{"role": "user", "content": "word " * 20000}]}
            ).encode()  # fmt: skip
            conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
            return "refused" if conn.getresponse().status == 400 else "unexpected"
        body = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        headers = {"Content-Type": "application/json"}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            return "unexpected"
        for raw in resp:
            line = raw.decode().strip()
            if i % 5 == 1 and line.startswith("data: ") and '"content"' in line:
                return "aborted"  # hang up mid-answer (the connection closes in `finally`)
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("finish_reason") in ("stop", "length"):
                    return "completed"
        return "incomplete"
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--server-arg", action="append", default=[], help="Extra `mtp serve` argument (repeatable).")
    p.add_argument("--json", help="Write the report here as JSON.")
    args = p.parse_args(argv)
    if not 1 <= args.requests <= 1000 or not 1 <= args.concurrency <= 64:
        p.error("--requests must be in 1..1000 and --concurrency in 1..64")
    server = _LocalServer("mtp", None, args.server_arg, "float32")
    try:
        warm = min(20, args.requests)
        counts: dict[str, int] = {}
        rss = []
        t0 = time.perf_counter()
        chunks = [(0, warm)] + [(a, min(a + 40, args.requests)) for a in range(warm, args.requests, 40)]
        with ThreadPoolExecutor(args.concurrency) as pool:
            for start, stop in chunks:

                def one(i: int) -> str:
                    return _one(server.port, server.model_name, i, args.max_tokens)

                for r in pool.map(one, range(start, stop)):
                    counts[r] = counts.get(r, 0) + 1
                time.sleep(1.0)  # let aborted rows be dropped before reading memory
                rss.append(_rss_mb(server.proc.pid))
        wall = time.perf_counter() - t0
        alive = server.proc.poll() is None
    finally:
        server.close()
    report = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "outcomes": counts,
        "rss_after_warmup_mb": round(rss[0], 1),
        "rss_at_end_mb": round(rss[-1], 1),
        "rss_growth_mb": round(rss[-1] - rss[0], 1),
        "rss_mb_after_each_chunk": [round(x, 1) for x in rss],  # warm-up, then every 40 requests
        "server_alive": alive,
        "wall_s": round(wall, 1),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    bad = counts.get("unexpected", 0) + counts.get("incomplete", 0)
    return 0 if alive and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
