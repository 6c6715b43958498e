"""vLLM plain vs vLLM + our exported drafters vs vLLM n-gram, at batch 1, 8 and 32, with acceptance per position.

Why a separate script: vLLM lives in its own environment (its CPU build pins transformers and pulls its own
stack), so this script drives it in subprocesses, one fresh `LLM` per configuration, and compares with our
own decoder run in-process on the same prompts with the same drafter (a chain of the same length).

    python -m mtp.bench.vllm_bench                         # the default model + shipped heads, all configs
    python bench/vllm_bench.py --max-tokens 64 --mtbench 8 --configs plain,mtp3
    python bench/vllm_bench.py --configs plain,mtp1,eagle3,ngram3 --eagle-heads runs/eagle-x   # + an EAGLE-3 export

Configs: plain, mtp<k> (the MTP export, k drafts), eagle<k> (an EAGLE-3 export, `--eagle-export-dir` or exported
now from `--eagle-heads`), ngram<k> (vLLM's prompt lookup).

Prompts: MT-Bench first turns (round-robin over categories) plus HELD_OUT, 8 customer-support and code
prompts no training or tuning decision touched. Batch B submits B prompts to one `generate` call; batch 1
runs the first --batch1-prompts prompts one at a time. Acceptance per position comes from vLLM's own
spec-decode counters (`vllm:spec_decode_num_accepted_tokens_per_pos` / `..._num_drafts`), read before and
after each batch size. Results: bench/results/vllm/<stamp>/results.json + results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:
    # Run as a file: its folder heads sys.path, and bench/profile.py would shadow the stdlib `profile`.
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

HELD_OUT = [
    "My order #48213 arrived with a cracked screen. I'd like a replacement, not a refund. What do I need to do?",
    "I was charged twice for my monthly subscription this month. How can I get the duplicate charge refunded?",
    "How do I change the email address on my account? I no longer have access to the old one.",
    "Your app logs me out every time I switch to another app on my phone. How can I fix this?",
    "Write a Python function that returns the n most common words in a text file, ignoring case and punctuation.",
    "Explain what this does and fix the bug: def avg(xs): return sum(xs) / len(xs) if xs else sum(xs) / 0",
    "Write a SQL query that lists customers who placed more than three orders in the last 30 days.",
    "Convert this loop to a list comprehension:\nresult = []\nfor x in items:\n    if x > 0:\n"
    "        result.append(x * 2)",
]
RESULTS_DIR = Path(__file__).resolve().parent / "results" / "vllm"
SPEC_METRICS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
)
# vLLM's CPU build on a small machine: a fixed KV budget, the cores bound explicitly, the engine in-process
# (the spawned engine core re-imports __main__), and Intel OpenMP preloaded where the wheel ships it
# (vLLM warns that speculative decoding on CPU is much slower without it).
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


@dataclass
class Phase:
    """One batch size of one configuration."""

    batch_size: int
    prompts: int
    tokens: int
    seconds: float
    num_drafts: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance(self) -> list[float]:
        """Per draft position: the share of drafts whose token at that position was accepted."""
        return [a / self.num_drafts for a in self.accepted_per_pos] if self.num_drafts else []

    @property
    def tau(self) -> float | None:
        """Mean tokens per verify step, bonus included (vLLM's mean acceptance length)."""
        return 1 + sum(self.acceptance) if self.num_drafts else None


def vllm_env() -> dict[str, str]:
    env = {**os.environ, **{k: v for k, v in VLLM_ENV.items() if k not in os.environ}}
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.is_file() and "LD_PRELOAD" not in os.environ:
        env["LD_PRELOAD"] = str(iomp)
    return env


def bench_prompts(mtbench: int) -> list[dict[str, str]]:
    """MT-Bench first turns (round-robin over categories), then HELD_OUT."""
    from mtp.bench.mtbench import load_mtbench

    rows = [{"id": f"mt{q.question_id}", "set": q.category, "text": q.turns[0]} for q in load_mtbench(mtbench)]
    return rows + [{"id": f"held{i}", "set": "held-out", "text": t} for i, t in enumerate(HELD_OUT)]


# ---- worker: one LLM, runs inside the vLLM environment ----------------------------------------------------


def _spec_counters(llm: Any) -> tuple[int, list[int]]:
    drafts, per_pos = 0, []
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            drafts = int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [int(v) for v in metric.values]
    return drafts, per_pos


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """Run `job` (model, speculative_config, prompts, batch sizes, ...) in one fresh vLLM `LLM`."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=job["model"],
        speculative_config=job.get("speculative_config"),
        dtype=job.get("dtype", "bfloat16"),
        max_model_len=job.get("max_model_len", 2048),
        max_num_seqs=max(job["batch_sizes"]),
        enforce_eager=job.get("enforce_eager", False),
        disable_log_stats=False,
        seed=0,
    )
    load_s = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in job["prompts"]
    ]
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    llm.generate(texts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    phases, outputs = [], {}
    for batch in job["batch_sizes"]:
        n = job.get("batch1_prompts", len(texts)) if batch == 1 else len(texts)
        d0, a0 = _spec_counters(llm)
        tokens, t0 = 0, time.perf_counter()
        for lo in range(0, n, batch):
            for i, out in enumerate(llm.generate(texts[lo : min(n, lo + batch)], params, use_tqdm=False)):
                ids = list(out.outputs[0].token_ids)
                tokens += len(ids)
                outputs.setdefault(str(batch), {})[str(lo + i)] = ids
        seconds = time.perf_counter() - t0
        d1, a1 = _spec_counters(llm)
        accepted = [b - (a0[i] if i < len(a0) else 0) for i, b in enumerate(a1)]
        phases.append(asdict(Phase(batch, n, tokens, seconds, d1 - d0, accepted)))
    # the machine's load while this ran (other processes on a small CPU skew tokens/s; the ratios stay in-run)
    return {"load_seconds": load_s, "phases": phases, "outputs": outputs, "loadavg_after": os.getloadavg()}


def run_vllm(job: dict[str, Any], python: str | None = None, timeout: float = 1800) -> dict[str, Any]:
    """`worker(job)` in a fresh subprocess (vLLM keeps process-wide state; one engine per process)."""
    with tempfile.TemporaryDirectory() as tmp:
        job_file, result_file = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_file.write_text(json.dumps(job))
        cmd = [python or sys.executable, "-m", "mtp.bench.vllm_bench", "--worker", str(job_file), str(result_file)]
        proc = subprocess.run(cmd, env=vllm_env(), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not result_file.is_file():
            raise RuntimeError(f"vLLM worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(result_file.read_text())


# ---- our decoder on the same prompts ----------------------------------------------------------------------


def ours_acceptance(model: Any, tokenizer: Any, prompts: list[str], max_tokens: int, chain: int) -> dict[str, Any]:
    """Our decoder with a chain of `chain` drafts (no tree, no prompt lookup): acceptance per position.

    Position j's rate counts the steps whose accepted run reached j+1 drafts, over all steps, which is how
    vLLM counts (its last step of an answer may also be cut by max_tokens or EOS).
    """
    import torch

    steps, reached, tokens, seconds = 0, [0] * chain, 0, 0.0
    outputs = []
    for text in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_tokens, tree=[[0] * (j + 1) for j in range(chain)],
                                 prompt_lookup=False, return_dict_in_generate=True)  # fmt: skip
        seconds += time.perf_counter() - t0
        tokens += out.num_new_tokens
        outputs.append(out.sequences[0, ids.shape[1] :].tolist())
        for n in out.accepted_lengths:
            steps += 1
            for j in range(min(n - 1, chain)):
                reached[j] += 1
    return {
        "steps": steps,
        "acceptance": [r / steps for r in reached] if steps else [],
        "tau": sum(reached) / steps + 1 if steps else None,
        "tokens": tokens,
        "seconds": seconds,
        "outputs": outputs,
    }


def _chat_ids(tokenizer: Any, text: str) -> Any:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


def eagle_reference_acceptance(
    model: Any, tokenizer: Any, prompts: list[str], answers: list[list[int]], max_tokens: int, chain: int
) -> dict[str, Any]:
    """What vLLM's EAGLE-3 chain should accept with this drafter (`model.heads`, head_type eagle) on these
    greedy answers, computed from the drafter's own `step`/`logits`, the way vLLM drafts:

    after every verify step (and after the prefill) with c tokens committed, the drafter's context is the
    teacher-forced depth-0 entries at positions 0..c-2 (token x_{t+1}, fused base features g_t), and the
    chain runs `chain` deep from position c-2, each depth reading the previous one's pre-norm output and its
    own drafted token. A step accepts the longest prefix of the chain that equals the answer (the base's
    greedy tokens), then commits it plus one token. Position j's rate counts the steps whose accepted run
    reached j+1 drafts, over all steps (vLLM's `accepted_per_pos / num_drafts`). An answer that stopped at
    `max_tokens` is extended by the base's greedy tokens, since vLLM counts drafts accepted past the limit.
    """
    import torch
    from transformers import DynamicCache

    from mtp.eagle import select_features

    heads, base = model.heads, model.base_model
    steps, reached = 0, [0] * chain
    for text, answer in zip(prompts, answers, strict=True):
        prompt = _chat_ids(tokenizer, text)
        P, n_answer = prompt.shape[1], len(answer)
        seq = torch.cat([prompt, torch.tensor([answer], dtype=prompt.dtype)], dim=1)
        with torch.no_grad():
            base_out = base(seq, output_hidden_states=True, use_cache=True)
            g = heads.combine(select_features(base_out.hidden_states, heads.feature_layers))
            # depth 0 over the whole answer at once: entry t reads x_{t+1} and g_t and sees entries <= t, so
            # entries 0..c-2 of this pass are exactly the context vLLM holds when c tokens are committed
            T = seq.shape[1] - 1
            if n_answer >= max_tokens:  # the base's next greedy tokens, to check drafts past the limit
                past, logits = base_out.past_key_values, base_out.logits[:, -1:]
                for i in range(chain):
                    seq = torch.cat([seq, logits.argmax(-1)], dim=1)
                    if i + 1 < chain:
                        step_out = base(seq[:, -1:], past_key_values=past, use_cache=True)
                        past, logits = step_out.past_key_values, step_out.logits
            full = DynamicCache()
            mask = torch.full((T, T), torch.finfo(g.dtype).min, dtype=g.dtype).triu_(1)[None, None]
            out0 = heads.step(g[:, :T], seq[:, 1 : T + 1], torch.arange(T)[None], mask, cache=full)
            keys, values = full.layers[0].keys, full.layers[0].values
            c = P + 1  # the prefill committed the prompt and the first answer token
            while c - P < n_answer:
                out = out0[:, c - 2 : c - 1]
                cache = DynamicCache()
                cache.update(keys[:, :, : c - 1].clone(), values[:, :, : c - 1].clone(), 0)
                drafts = []
                for j in range(chain):
                    d = heads.draft_ids[heads.logits(out).argmax(-1)]  # (1, 1) base token id
                    drafts.append(int(d))
                    if j + 1 < chain:  # the next depth: this output and its draft, one position on
                        pos = torch.tensor([[c - 1 + j]])
                        out = heads.step(out, d, pos, torch.zeros(1, 1, 1, c + j, dtype=g.dtype), cache=cache)
                truth = seq[0, c : c + chain].tolist()
                accepted = 0
                while accepted < min(chain, len(truth)) and drafts[accepted] == truth[accepted]:
                    accepted += 1
                steps += 1
                for j in range(accepted):
                    reached[j] += 1
                c += accepted + 1
    return {
        "steps": steps,
        "acceptance": [r / steps for r in reached] if steps else [],
        "tau": sum(reached) / steps + 1 if steps else None,
    }


# ---- main -------------------------------------------------------------------------------------------------


def _markdown(res: dict[str, Any]) -> str:
    lines = [
        f"# vLLM {res.get('vllm_version', '?')} on this CPU: plain vs our drafter vs n-gram",
        "",
        f"{res['n_prompts']} prompts ({res['mtbench']} MT-Bench first turns + {len(HELD_OUT)} held-out), "
        f"greedy, max {res['max_tokens']} new tokens, dtype {res['dtype']}; batch 1 = the first "
        f"{res['batch1_prompts']} prompts one at a time.",
        "",
        "Load average (1/5/15 min) after each configuration: on a shared 2-core machine tokens/s follow it; "
        "acceptance does not.",
        "",
        "| config | speculative_config | load s | " + " | ".join(f"b{b} tok/s" for b in res["batch_sizes"]) + " | "
        + " | ".join(f"b{b} vs plain" for b in res["batch_sizes"]) + " | acceptance per position (b1) | τ (b1) "
        "| load avg after |",
        "|---|---|---|" + "---|" * (2 * len(res["batch_sizes"]) + 3),
    ]  # fmt: skip
    plain = {p["batch_size"]: p for p in res["configs"].get("plain", {}).get("phases", [])}
    for name, run in res["configs"].items():
        if "error" in run:
            lines.append(f"| {name} | `{json.dumps(run['speculative_config'])}` | failed: {run['error'][:80]} |")
            continue
        phases = [Phase(**p) for p in run["phases"]]
        speeds = [f"{p.tok_s:.1f}" for p in phases]
        ratios = [
            f"{p.tok_s / Phase(**plain[p.batch_size]).tok_s:.2f}x" if p.batch_size in plain else "–" for p in phases
        ]
        first = phases[0]
        acc = ", ".join(f"{a:.2f}" for a in first.acceptance) or "–"
        tau = f"{first.tau:.2f}" if first.tau else "–"
        spec = json.dumps(run["speculative_config"]) if run["speculative_config"] else "none"
        load = "/".join(f"{x:.1f}" for x in run.get("loadavg_after") or []) or "?"
        lines.append(
            f"| {name} | `{spec}` | {run['load_seconds']:.0f} | "
            + " | ".join(speeds) + " | " + " | ".join(ratios) + f" | {acc} | {tau} | {load} |"
        )  # fmt: skip
    ours_runs = res.get("ours") or []
    for ours in [ours_runs] if isinstance(ours_runs, dict) else ours_runs:  # (a dict in early runs)
        lines += [
            "",
            f"Our decoder, same drafter (full vocabulary), chain of {ours['chain']}, no prompt lookup, "
            f"the batch-1 prompts, {ours['dtype']}: acceptance per position "
            + ", ".join(f"{a:.2f}" for a in ours["acceptance"])
            + f", τ {ours['tau']:.2f}, {ours['tokens'] / ours['seconds']:.1f} tok/s (transformers eager).",
        ]
    for ref in res.get("ours_eagle") or []:
        lines += [
            "",
            f"EAGLE drafter reference (its own chain of {ref['chain']} on vLLM plain's batch-1 answers, fp32, "
            "`eagle_reference_acceptance`): acceptance per position "
            + ", ".join(f"{a:.2f}" for a in ref["acceptance"])
            + f", τ {ref['tau']:.2f} over {ref['steps']} steps.",
        ]
    for name, run in res["configs"].items():
        same = run.get("identical_to_plain")
        if same is not None:
            lines.append(f"- {name}: batch-1 outputs identical to vLLM plain: {same}")
    return "\n".join(lines) + "\n"


def _eagle_export(args: argparse.Namespace, out_dir: Path) -> tuple[Any, Path, Path]:
    """(the EAGLE model for the reference or None, the export directory (base), its eagle3/ draft)."""
    from mtp.export_vllm import EXPORT_INFO

    eagle_model = None
    if args.eagle_export_dir:
        export = Path(args.eagle_export_dir)
    elif args.eagle_heads:
        import torch

        from mtp.export_vllm import export_vllm
        from mtp.train.export import _load

        eagle_model, eagle_tokenizer = _load(Path(args.eagle_heads), False, torch.float32)
        if eagle_model.config.head_type != "eagle":
            raise SystemExit(f"--eagle-heads {args.eagle_heads} holds {eagle_model.config.head_type!r} heads")
        export = out_dir / "export-eagle"
        export_vllm(eagle_model, export, dtype=args.dtype, tokenizer=eagle_tokenizer)
    else:
        raise SystemExit("eagle<k> configs need --eagle-export-dir or --eagle-heads (no EAGLE heads ship)")
    info = json.loads((export / EXPORT_INFO).read_text()) if (export / EXPORT_INFO).is_file() else {}
    spec = info.get("speculative_config") or {}
    if spec.get("method") != "eagle3":
        raise SystemExit(f"{export} is not an EAGLE-3 export (`mtp export <eagle heads> --to vllm`)")
    return eagle_model, export, Path(spec["model"])


def _identical(run: dict[str, Any], plain: dict[str, Any]) -> str:
    a, b = run["outputs"].get("1", {}), plain["outputs"].get("1", {})
    same = sum(a[k] == b.get(k) for k in a)
    return f"{same}/{len(a)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="plain,mtp1,mtp3,ngram3", help="plain, mtp<k>, eagle<k>, ngram<k>")
    parser.add_argument("--mtbench", type=int, default=24, help="MT-Bench first turns (round-robin)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--batch1-prompts", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--export-dir", default=None, help="an `mtp export --to vllm` of head_type mtp (default: "
                        "export the shipped heads now)")  # fmt: skip
    parser.add_argument("--eagle-export-dir", default=None, help="an `mtp export --to vllm` of head_type eagle "
                        "(for eagle<k>)")  # fmt: skip
    parser.add_argument("--eagle-heads", default=None, help="a checkpoint or training run with EAGLE heads, "
                        "exported now (for eagle<k>; also gives the drafter's reference acceptance)")  # fmt: skip
    parser.add_argument("--no-ours", action="store_true", help="skip our own decoder's acceptance run")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        job = json.loads(Path(args.worker[0]).read_text())
        Path(args.worker[1]).write_text(json.dumps(worker(job)))
        return 0

    import torch

    from mtp.default_model import default_model_dir, load_default_mtp
    from mtp.export_vllm import export_vllm

    torch.set_num_threads(2)
    prompts = bench_prompts(args.mtbench)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out) if args.out else RESULTS_DIR / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    names = args.configs.split(",")
    model, tokenizer, _ = load_default_mtp(torch.float32, "mtp")  # the MTP export; EAGLE: --eagle-heads
    export_dir = Path(args.export_dir) if args.export_dir else out_dir / "export-mtp"
    if not args.export_dir and any(n.startswith("mtp") for n in names):
        export_vllm(model, export_dir, dtype=args.dtype, tokenizer=tokenizer)
    eagle_model, eagle_dir, eagle_draft = None, None, None
    if any(n.startswith("eagle") for n in names):
        eagle_model, eagle_dir, eagle_draft = _eagle_export(args, out_dir)
    base_dir = str(default_model_dir())
    try:
        import vllm

        version = vllm.__version__
    except ImportError:
        version = "?"
    res: dict[str, Any] = {
        "vllm_version": version, "mtbench": args.mtbench, "n_prompts": len(prompts), "prompts": prompts,
        "max_tokens": args.max_tokens, "dtype": args.dtype, "batch_sizes": batch_sizes,
        "batch1_prompts": args.batch1_prompts, "configs": {},
    }  # fmt: skip
    job = {"prompts": [p["text"] for p in prompts], "max_tokens": args.max_tokens, "batch_sizes": batch_sizes,
           "batch1_prompts": args.batch1_prompts, "dtype": args.dtype}  # fmt: skip
    for name in names:
        if name == "plain":
            model_dir, spec = base_dir, None
        elif name.startswith("mtp"):
            model_dir, spec = str(export_dir), {"method": "mtp", "num_speculative_tokens": int(name[3:])}
        elif name.startswith("eagle"):
            model_dir = str(eagle_dir)
            spec = {"method": "eagle3", "model": str(eagle_draft), "num_speculative_tokens": int(name[5:])}
        elif name.startswith("ngram"):
            k = int(name[5:])
            model_dir, spec = base_dir, {"method": "ngram", "num_speculative_tokens": k,
                                         "prompt_lookup_max": 4, "prompt_lookup_min": 2}  # fmt: skip
        else:
            raise SystemExit(f"unknown config {name!r}")
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {spec}", flush=True)
        try:
            run = run_vllm({**job, "model": model_dir, "speculative_config": spec})
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            run = {"error": str(e)}
            print(run["error"], file=sys.stderr)
        res["configs"][name] = {"speculative_config": spec, "model": model_dir, **run}
        (out_dir / "results.json").write_text(json.dumps(res, indent=1))
    plain = res["configs"].get("plain")
    for name, run in res["configs"].items():
        if name != "plain" and plain and "error" not in run and "error" not in plain:
            run["identical_to_plain"] = _identical(run, plain)
    if not args.no_ours:
        chains = sorted({int(n[3:]) for n in names if n.startswith("mtp")})
        model.set_draft_vocab(None)  # the export drafts from the full vocabulary
        model = model.to(torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
        res["ours"] = []
        for chain in chains:
            print(f"[{time.strftime('%H:%M:%S')}] ours: chain {chain}", flush=True)
            ours = ours_acceptance(model, tokenizer, job["prompts"][: args.batch1_prompts], args.max_tokens, chain)
            res["ours"].append({"chain": chain, "dtype": args.dtype, **ours})
        eagle_chains = sorted({int(n[5:]) for n in names if n.startswith("eagle")})
        if eagle_model is not None and eagle_chains and plain and "error" not in plain:
            answers = [plain["outputs"]["1"][str(i)] for i in range(args.batch1_prompts)]
            res["ours_eagle"] = []
            for chain in eagle_chains:
                print(f"[{time.strftime('%H:%M:%S')}] EAGLE reference: chain {chain}", flush=True)
                ref = eagle_reference_acceptance(eagle_model, tokenizer, job["prompts"][: args.batch1_prompts],
                                                 answers, args.max_tokens, chain)  # fmt: skip
                res["ours_eagle"].append({"chain": chain, **ref})
    (out_dir / "results.json").write_text(json.dumps(res, indent=1))
    (out_dir / "results.md").write_text(_markdown(res))
    print(_markdown(res))
    print(f"wrote {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
