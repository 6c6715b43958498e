"""Load test on loopback: output tokens/s, latency and time to first token per concurrency level.

    python bench/load.py                        # `mtp serve` on the embedded model, speculative and plain
    python bench/load.py --concurrency 1,2,4,8,16 --servers mtp,transformers --server-arg=--dtype \
        --server-arg=bfloat16 --json bench/latest/load/results.json --plot bench/latest/load/results.png
    python bench/load.py --url http://127.0.0.1:8000 --model-name NAME   # an already running server

Servers: `mtp` starts `mtp serve` and runs two modes on it, `"speculative": true` and `false` per request (the
two columns then differ only in that switch); `transformers` starts `transformers serve --continuous-batching`
on the same model directory and dtype, and gets plain OpenAI bodies (it rejects unknown fields). Each level
sends `--requests` requests (default: max(8, 2 x concurrency)), `concurrency` at a time, each a streamed greedy
chat completion of one of the short customer-support prompts below; time to first token is measured as a
client sees it. Loopback only (it refuses other hosts: this is a benchmark, not a load generator for someone
else's server) and bounded: at most 500 requests per level and mode, and --time-limit seconds each.
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

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # run as a script: bench/profile.py would shadow the standard library's profile module

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
        ttft, usage, chunks, tau = None, None, 0, 1.0
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Result(False, error=chunk["error"]["message"])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            if "tau" in chunk.get("mtp", {}):
                tau = chunk["mtp"]["tau"]
        latency = time.perf_counter() - t0
        tokens = usage if usage is not None else chunks  # no usage chunk: one content chunk per token
        return Result(True, latency=latency, ttft=ttft if ttft is not None else latency, tokens=tokens, tau=tau)
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        return Result(False, error=f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def run_mode(args: argparse.Namespace, host: str, port: int, mode: str, concurrency: int, requests: int) -> dict:
    """`requests` requests, `concurrency` at a time, stopping new ones after `--time-limit` s.

    mode: "speculative" / "plain" (an `mtp serve`: the extension field set per request) or "openai" (any other
    OpenAI-compatible server: a plain body)."""

    def body(i: int) -> dict:
        b = {
            "model": args.model_name,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if mode != "openai":
            b["speculative"] = mode == "speculative"
        return b

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
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(task, range(requests)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    lat, ttft = [r.latency for r in ok], [r.ttft for r in ok]
    return {
        "mode": mode,
        "concurrency": concurrency,
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "skipped_by_time_limit": requests - len(results),
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
    """A server on a free loopback port for the duration of the benchmark: `mtp serve` or `transformers serve`."""

    def __init__(self, kind: str, model: str | None, extra: list[str], dtype: str):
        self.port = _free_port()
        if kind == "mtp":
            cmd = [sys.executable, "-m", "mtp.cli", "serve", "--port", str(self.port), *extra]
            if model:
                cmd += ["--model", model]
        else:  # the same weights as a plain HF checkpoint, served by transformers' own continuous batching
            from mtp.default_model import default_model_dir

            path = model or str(default_model_dir())
            cmd = ["transformers", "serve", path, "--continuous-batching", "--dtype", dtype, "--device", "cpu"]
            cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"{kind}-load-{self.port}.log"
        self._out = self.log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{kind} server exited; see {self.log}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/v1/models" if kind != "mtp" else "/health")
                body = json.loads(conn.getresponse().read())
                self.model_name = body["model"] if kind == "mtp" else (path if model is None else model)
                return
            except (OSError, ValueError, KeyError):
                time.sleep(0.5)
        raise SystemExit(f"{kind} server did not come up in 300 s; see {self.log}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._out.close()


def _levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or any(not 1 <= c <= 64 for c in levels):
        raise ValueError("--concurrency takes levels between 1 and 64, e.g. 1,2,4,8,16")
    return levels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="A running `mtp serve` (loopback only). Default: start the servers.")
    p.add_argument("--model", help="Checkpoint for the servers this script starts (default: the embedded model).")
    p.add_argument("--model-name", help="Model id to send (default: what the server reports).")
    p.add_argument("--api-key", default=os.environ.get("MTP_API_KEY"))
    p.add_argument("--requests", type=int, help=f"Requests per level and mode (default max(8, 2 x concurrency), "
                   f"at most {MAX_REQUESTS}).")  # fmt: skip
    p.add_argument("--concurrency", default="4", help="Concurrency levels, e.g. 1,2,4,8,16.")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--time-limit", type=float, default=300.0, help="Seconds per level and mode.")
    p.add_argument("--timeout", type=float, default=300.0, help="Per-request timeout in seconds.")
    p.add_argument("--modes", default="speculative,plain", help="Modes on mtp serve: speculative,plain | one.")
    p.add_argument("--servers", default="mtp", help="mtp | transformers | mtp,transformers (started here).")
    p.add_argument("--server-arg", action="append", default=[], help="Extra `mtp serve` argument (repeatable).")
    p.add_argument("--json", help="Write the report here as JSON.")
    p.add_argument("--plot", help="Write a PNG of tok/s and p95 latency per concurrency level here.")
    args = p.parse_args(argv)
    try:
        levels = _levels(args.concurrency)
    except ValueError as e:
        p.error(str(e))
    if args.requests is not None and not 1 <= args.requests <= MAX_REQUESTS:
        p.error(f"--requests must be between 1 and {MAX_REQUESTS}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"speculative", "plain"}:
        p.error("--modes takes speculative and/or plain")
    servers = [x.strip() for x in args.servers.split(",") if x.strip()]
    if not servers or set(servers) - {"mtp", "transformers"} or (args.url and servers != ["mtp"]):
        p.error("--servers takes mtp and/or transformers (with --url: mtp only)")
    dtype = "float32"
    if "--dtype" in args.server_arg:
        dtype = args.server_arg[args.server_arg.index("--dtype") + 1]
    dtype = next((a.split("=", 1)[1] for a in args.server_arg if a.startswith("--dtype=")), dtype)

    # columns: (label, server kind, mode)
    columns = [(f"mtp-{m}", "mtp", m) for m in modes if "mtp" in servers]
    if "transformers" in servers:
        columns.append(("transformers-cb", "transformers", "openai"))
    report = {"model": None, "max_tokens": args.max_tokens, "dtype": dtype, "levels": []}
    results: dict[str, dict[int, dict]] = {label: {} for label, _, _ in columns}
    given_name = args.model_name
    for kind in dict.fromkeys(k for _, k, _ in columns):
        server = None
        if args.url:
            url = urlparse(args.url)
            if url.hostname not in LOOPBACK:
                p.error(f"--url must point at this machine ({', '.join(sorted(LOOPBACK))}), not {url.hostname}")
            host, port = url.hostname, url.port or 80
        else:
            server = _LocalServer(kind, args.model, args.server_arg, dtype)
            host, port = "127.0.0.1", server.port
        try:
            name = server.model_name if server else given_name
            if name is None:
                conn = http.client.HTTPConnection(host, port, timeout=10)
                conn.request("GET", "/health")
                name = json.loads(conn.getresponse().read())["model"]
            report["model"] = report["model"] or name
            args.model_name = name  # each server knows the model by its own id
            for c in levels:
                n = args.requests or max(8, 2 * c)
                for label, k, mode in columns:
                    if k == kind:
                        results[label][c] = run_mode(args, host, port, mode, c, min(n, MAX_REQUESTS))
                        print(f"  {label:<18} concurrency {c:>2}: {results[label][c]['output_tokens_per_s']:.1f} "
                              f"tok/s, p95 {results[label][c]['latency_p95_s']:.2f} s", flush=True)  # fmt: skip
        finally:
            if server is not None:
                server.close()
    for c in levels:
        report["levels"].append({"concurrency": c, "modes": {label: results[label][c] for label, _, _ in columns}})
    _print(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        _plot(report, args.plot)
    failed = sum(m["errors"] for level in report["levels"] for m in level["modes"].values())
    return 1 if failed else 0


def _print(report: dict) -> None:
    print(f"model {report['model']}: max_tokens {report['max_tokens']}, {report['dtype']} (greedy, streamed)")
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
    print(f"{'conc':>4} {'server / mode':<18}" + "".join(f"{c[0]:>13}" for c in cols))
    for level in report["levels"]:
        for name, m in level["modes"].items():
            cells = [fmt.format(m[key]) if key else f"{m['completed']}/{m['errors']}" for _, key, fmt in cols]
            print(f"{level['concurrency']:>4} {name:<18}" + "".join(f"{c:>13}" for c in cells))


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [lv["concurrency"] for lv in report["levels"]]
    names = list(report["levels"][0]["modes"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        a.plot(levels, [lv["modes"][name]["output_tokens_per_s"] for lv in report["levels"]], "o-", label=name)
        b.plot(levels, [lv["modes"][name]["latency_p95_s"] for lv in report["levels"]], "o-", label=name)
    for ax, title in ((a, "output tokens/s (all requests)"), (b, "latency p95 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    a.legend()
    fig.suptitle(f"{report['model']}, {report['dtype']}, max_tokens {report['max_tokens']}, loopback")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
