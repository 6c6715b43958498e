"""Load test for `mtp serve`: requests/s, latency and time to first token, with and without speculation.

    python bench/load.py                        # starts `mtp serve` on the embedded model, loopback
    python bench/load.py --model ckpt/          # ... on a checkpoint
    python bench/load.py --url http://127.0.0.1:8000 --model-name NAME   # an already running server

Loopback only (it refuses other hosts: this is a benchmark, not a load generator for someone else's
server) and bounded: at most --requests requests per mode (hard cap 500) and --time-limit seconds per
mode. Each request streams a chat completion (greedy), so time to first token is measured as a client
sees it: from sending the request to the first content chunk. The same prompts run once with
speculation (`"speculative": true`) and once without, so the two columns differ only in that switch.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

MAX_REQUESTS = 500
LOOPBACK = {"127.0.0.1", "localhost", "::1"}

# Short customer-support questions: the use case the server is built for.
PROMPTS = [
    "Hi, my order hasn't arrived yet. What should I do?",
    "How do I reset my password?",
    "Can I change the delivery address after ordering?",
    "What is your return policy for electronics?",
    "My package arrived damaged. How can I get a replacement?",
    "Do you ship internationally, and how long does it take?",
    "How can I cancel my subscription?",
    "Why was my card declined at checkout?",
    "Can I get an invoice for my purchase?",
    "How do I track my order?",
    "Is there a discount for students?",
    "What payment methods do you accept?",
]


@dataclass
class Result:
    ok: bool
    latency: float = 0.0
    ttft: float = 0.0
    tokens: int = 0
    tau: float = 1.0
    error: str = ""


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def one_request(host: str, port: int, body: dict, api_key: str | None, timeout: float) -> Result:
    """One streamed chat completion; times are client-side."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            return Result(False, error=f"HTTP {resp.status}: {resp.read()[:200]!r}")
        ttft, tokens, tau = None, 0, 1.0
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Result(False, error=chunk["error"]["message"])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content") and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if "tau" in chunk.get("mtp", {}):
                tau = chunk["mtp"]["tau"]
        latency = time.perf_counter() - t0
        return Result(True, latency=latency, ttft=ttft if ttft is not None else latency, tokens=tokens, tau=tau)
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        return Result(False, error=f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def run_mode(args: argparse.Namespace, host: str, port: int, speculative: bool) -> dict:
    """`--requests` requests, `--concurrency` at a time, stopping new ones after `--time-limit` s."""

    def body(i: int) -> dict:
        return {
            "model": args.model_name,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "speculative": speculative,
        }

    one_request(host, port, body(0) | {"max_tokens": 2}, args.api_key, args.timeout)  # warm-up, not counted
    deadline = time.perf_counter() + args.time_limit
    results: list[Result] = []
    lock = threading.Lock()

    def task(i: int) -> None:
        if time.perf_counter() > deadline:
            return
        r = one_request(host, port, body(i), args.api_key, args.timeout)
        with lock:
            results.append(r)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(task, range(args.requests)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    lat, ttft = [r.latency for r in ok], [r.ttft for r in ok]
    return {
        "speculative": speculative,
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "skipped_by_time_limit": args.requests - len(results),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 4) if wall > 0 else 0.0,
        "output_tokens_per_s": round(sum(r.tokens for r in ok) / wall, 2) if wall > 0 else 0.0,
        "latency_p50_s": round(_percentile(lat, 0.5), 4),
        "latency_p95_s": round(_percentile(lat, 0.95), 4),
        "ttft_p50_s": round(_percentile(ttft, 0.5), 4),
        "ttft_p95_s": round(_percentile(ttft, 0.95), 4),
        "tokens_mean": round(statistics.fmean([r.tokens for r in ok]), 2) if ok else 0.0,
        "tau_mean": round(statistics.fmean([r.tau for r in ok]), 4) if ok else 0.0,
        "first_error": next((r.error for r in results if not r.ok), ""),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _LocalServer:
    """`mtp serve` on a free loopback port for the duration of the benchmark."""

    def __init__(self, model: str | None, extra: list[str]):
        self.port = _free_port()
        cmd = [sys.executable, "-m", "mtp.cli", "serve", "--port", str(self.port), *extra]
        if model:
            cmd += ["--model", model]
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"mtp-load-{self.port}.log"
        self._out = self.log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"mtp serve exited; see {self.log}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                health = json.loads(conn.getresponse().read())
                self.model_name = health["model"]
                return
            except (OSError, ValueError):
                time.sleep(0.5)
        raise SystemExit(f"mtp serve did not come up in 300 s; see {self.log}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._out.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="A running server (loopback only). Default: start one.")
    p.add_argument("--model", help="Checkpoint for the server this script starts (default: the embedded model).")
    p.add_argument("--model-name", help="Model id to send (default: what /health reports).")
    p.add_argument("--api-key", default=os.environ.get("MTP_API_KEY"))
    p.add_argument("--requests", type=int, default=16, help=f"Requests per mode (at most {MAX_REQUESTS}).")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--time-limit", type=float, default=300.0, help="Seconds per mode; later requests are skipped.")
    p.add_argument("--timeout", type=float, default=300.0, help="Per-request timeout in seconds.")
    p.add_argument("--modes", default="speculative,plain", help="speculative,plain | speculative | plain")
    p.add_argument("--server-arg", action="append", default=[], help="Extra `mtp serve` argument (repeatable).")
    p.add_argument("--json", help="Write the report here as JSON.")
    args = p.parse_args(argv)
    if not 1 <= args.requests <= MAX_REQUESTS:
        p.error(f"--requests must be between 1 and {MAX_REQUESTS}")
    if not 1 <= args.concurrency <= 64:
        p.error("--concurrency must be between 1 and 64")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"speculative", "plain"}:
        p.error("--modes takes speculative and/or plain")

    server = None
    if args.url:
        url = urlparse(args.url)
        if url.hostname not in LOOPBACK:
            p.error(f"--url must point at this machine ({', '.join(sorted(LOOPBACK))}), not {url.hostname}")
        host, port = url.hostname, url.port or 80
    else:
        server = _LocalServer(args.model, args.server_arg)
        host, port = "127.0.0.1", server.port
        args.model_name = args.model_name or server.model_name
    try:
        if args.model_name is None:
            conn = http.client.HTTPConnection(host, port, timeout=10)
            conn.request("GET", "/health")
            args.model_name = json.loads(conn.getresponse().read())["model"]
        report = {
            "model": args.model_name,
            "requests": args.requests,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "modes": {m: run_mode(args, host, port, speculative=(m == "speculative")) for m in modes},
        }
    finally:
        if server is not None:
            server.close()
    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    failed = sum(m["errors"] for m in report["modes"].values())
    return 1 if failed else 0


def _print(report: dict) -> None:
    print(
        f"model {report['model']}: {report['requests']} requests per mode, concurrency {report['concurrency']}, "
        f"max_tokens {report['max_tokens']} (greedy, streamed)"
    )
    cols = [
        ("requests/s", "requests_per_s", "{:.3f}"),
        ("out tok/s", "output_tokens_per_s", "{:.1f}"),
        ("latency p50", "latency_p50_s", "{:.2f} s"),
        ("latency p95", "latency_p95_s", "{:.2f} s"),
        ("TTFT p50", "ttft_p50_s", "{:.3f} s"),
        ("TTFT p95", "ttft_p95_s", "{:.3f} s"),
        ("τ", "tau_mean", "{:.2f}"),
        ("ok/err", None, None),
    ]
    print(f"{'mode':<12}" + "".join(f"{c[0]:>13}" for c in cols))
    for name, m in report["modes"].items():
        cells = [fmt.format(m[key]) if key else f"{m['completed']}/{m['errors']}" for _, key, fmt in cols]
        print(f"{name:<12}" + "".join(f"{c:>13}" for c in cells))


if __name__ == "__main__":
    sys.exit(main())
