"""`mtp bench`: the speed benchmark on MT-Bench and on held-out chat and code prompts, and the verify-cost curve.

MT-Bench is the set the trees and policies were tuned on; the held-out sets (bench/heldout.py: handwritten
prompts and the ShareGPT tail no training step read) are reported beside it, each with its own plain
`generate()` reference measured in the same run.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import typer

# chain, tree: the heads' drafts alone; tree_lookup: + prompt-lookup drafts in the same tree; auto: what
# `model.generate()` does by default (adaptive tree + lookup).
DEFAULT_METHODS = "plain,prompt_lookup,assisted,chain,tree,tree_lookup,auto,plain_packed,auto_packed"
# The compiled ones build their graphs first (minutes on 2 cores, not timed): only on request.
ALL_METHODS = DEFAULT_METHODS + ",auto_static_packed,plain_compiled,auto_compiled"
# prompt sets: MT-Bench first turns (--limit), held-out chat and code prompts (--heldout-n, --heldout-source)
ALL_SETS = "mtbench,heldout-chat,heldout-code"
KNOWN_SETS = ALL_SETS + ",heldout-followup"  # follow-ups (bench/heldout.py followups) run when asked for


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def bench(
    model: str = typer.Option("default", help="'default' (SmolLM2 + shipped heads) or an MTP checkpoint dir."),
    heads: str = typer.Option("", help="Heads dir for the default model, or a shipped set: eagle (default), mtp."),
    limit: int = typer.Option(80, help="MT-Bench questions (round-robin over categories)."),
    prompts: str = typer.Option(ALL_SETS, help="Comma-separated prompt sets, each reported apart: " + KNOWN_SETS),
    heldout_n: int = typer.Option(24, help="Prompts per held-out set (heldout-chat, heldout-code)."),
    heldout_source: str = typer.Option(
        "both", help="Held-out prompts: handwritten | sharegpt | both (alternating; see bench/heldout.py)."
    ),
    max_new_tokens: int = typer.Option(256),
    dtypes: str = typer.Option("float32,bfloat16", help="Comma-separated dtypes."),
    methods: str = typer.Option(
        DEFAULT_METHODS,
        help="Comma-separated subset of: " + ALL_METHODS + " (*_packed: decoding from prepacked weights, "
        "*_compiled: verify steps through torch.compile; plain_*: our loop drafting nothing, i.e. what packing "
        "or compiling alone gives).",
    ),
    tree: str = typer.Option("default", help="Tree for the 'tree' method: default | <node count> | JSON paths."),
    extra_heads: str = typer.Option(
        "",
        help="More heads on the same base, 'name=dir,...': adds '<name>-<m>' per requested chain/tree/auto.",
    ),
    assistant: str = typer.Option(
        "", help="Draft model dir for 'assisted' (from `mtp export --assistant`); empty: an untrained layer-skip one."
    ),
    assistant_layers: int = typer.Option(6, help="Layers of the untrained layer-skip assistant."),
    out: Path = typer.Option(Path("bench/results"), help="Where results.json/.md/.png go."),
    verify_cost: bool = typer.Option(True, help="Also measure the verify-cost curve per dtype."),
    methods_fp32: str = typer.Option("", help="A different method list for float32 (default: --methods)."),
    threads: int = typer.Option(0, help="torch threads (0: torch default)."),
    repeats: int = typer.Option(
        1,
        help="Time every prompt and method this many times (round-robin) and keep the median: one run of one "
        "prompt can be off by 15-20% on a shared machine, so per-prompt minimums want 3.",
    ),
    sampling_temperature: float = typer.Option(
        0.0, help="> 0: also time sampled decoding at this temperature (plain vs ours, lossless; τ, tokens/s)."
    ),
) -> None:
    """Batch 1, greedy, MT-Bench first turns and held-out prompts: plain vs prompt lookup vs assisted vs ours."""
    import torch

    from mtp import MTPModel
    from mtp.packed import bf16_matmul_units

    from .methods import assisted, plain, prompt_lookup
    from .mtbench import chat_prompt_ids, first_turn_ids
    from .run import markdown_table, run_prompts, summary_rows, write_outputs
    from .verify_cost import relative, verify_cost_curve

    if threads:
        torch.set_num_threads(threads)
    _methods(methods), _methods(methods_fp32 or methods)  # fail on a typo before loading anything
    texts = _prompt_sets(prompts, limit, heldout_n, heldout_source)  # set -> [(id, category, text | question)]
    rows, stats_by_run, costs, sampling = [], {}, {}, {}
    t_start = time.perf_counter()
    for dt in [d.strip() for d in dtypes.split(",") if d.strip()]:
        torch_dtype = getattr(torch, dt)
        wanted = _methods(methods_fp32 if dt == "float32" and methods_fp32 else methods)
        mtp_model, tokenizer = _load(model, heads, torch_dtype)
        sets = {
            name: [
                (qid, cat, first_turn_ids(tokenizer, x) if name == "mtbench" else chat_prompt_ids(tokenizer, x))
                for qid, cat, x in items
            ]
            for name, items in texts.items()
        }
        first = next(iter(sets.values()))
        table = {"plain": plain(mtp_model)}
        for name in wanted:
            if name == "prompt_lookup":
                table[name] = prompt_lookup(mtp_model)
            elif name == "assisted":
                table[name] = assisted(mtp_model, _assistant(mtp_model, assistant, assistant_layers, torch_dtype))
        table |= _decoding_methods(mtp_model, wanted, tree)
        for spec in [x for x in extra_heads.split(",") if x.strip()]:
            label, _, directory = spec.partition("=")
            if not directory:
                raise typer.BadParameter(f"--extra-heads wants name=dir, got {spec!r}")
            other = MTPModel.from_pretrained(directory.strip(), base_model=mtp_model.base_model)
            table |= _extra_head_methods(label.strip(), other, wanted, tree)
        mtp_model.generate(first[0][2][:, :8], max_new_tokens=4)  # warm-up
        for set_name, set_prompts in sets.items():
            typer.echo(f"[{dt}] {set_name}: {len(set_prompts)} prompts x {list(table)}")

            def progress(name, qid, seconds, diff, dt=dt, set_name=set_name):
                same = "identical" if diff is None else f"differs from plain at new token {diff}"
                label = f"q{qid}" if isinstance(qid, int) else qid
                typer.echo(f"  [{dt}] {set_name} {label} {name}: {seconds:.1f}s, {same}")

            stats = run_prompts(table, set_prompts, max_new_tokens, dt, progress, repeats=repeats)
            stats_by_run[f"{dt} {set_name}"] = stats
            rows.extend(summary_rows(stats, set_name))
        if sampling_temperature > 0:
            on = sets.get("mtbench", first)
            sampling[dt] = _sampling_run(mtp_model, on, max_new_tokens, sampling_temperature)
            typer.echo(f"[{dt}] sampling at T={sampling_temperature}: {sampling[dt]}")
        if verify_cost:
            costs[dt] = {k: round(v, 3) for k, v in relative(verify_cost_curve(mtp_model.base_model)).items()}
            typer.echo(f"[{dt}] verify cost (relative to k=1): {costs[dt]}")
    meta = {
        "cpu": _cpu_name(),
        # the same model name covers CPUs with and without bf16 matmul units: bf16 speed hinges on them
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_matmul": bf16_matmul_units(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "limit": limit,
        "prompt_sets": {
            name: {"count": len(items), "ids": [qid for qid, _, _ in items]}
            | ({"source": heldout_source} if name != "mtbench" else {})
            for name, items in texts.items()
        },
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "tree": tree,
        "assistant": _assistant_label(assistant, assistant_layers),
        "verify_cost": costs,
        "sampling": sampling,
        "wall_seconds": round(time.perf_counter() - t_start, 1),
    }
    write_outputs(out, rows, stats_by_run, meta)
    typer.echo(markdown_table(rows))
    typer.echo(json.dumps(meta, indent=2))
    typer.echo(f"wrote {out}/results.json, results.md, results.png")


def _methods(spec: str) -> list[str]:
    wanted = [m.strip() for m in spec.split(",") if m.strip()]
    unknown = set(wanted) - set(ALL_METHODS.split(","))
    if unknown:
        raise typer.BadParameter(f"unknown methods {sorted(unknown)}; known: {ALL_METHODS}")
    return wanted if "plain" in wanted else ["plain", *wanted]


def _prompt_sets(spec: str, limit: int, heldout_n: int, source: str) -> dict[str, list[tuple]]:
    """The prompts of each wanted set, before tokenizing: set -> [(id, category, MT-Bench question | text)].

    Sets with no prompts (--limit 0, --heldout-n 0) are left out; at least one set must remain."""
    wanted = [x.strip() for x in spec.split(",") if x.strip()]
    unknown = set(wanted) - set(KNOWN_SETS.split(","))
    if unknown or not wanted:
        raise typer.BadParameter(f"unknown prompt sets {sorted(unknown)}; known: {KNOWN_SETS}")
    from .heldout import SOURCES, heldout_set
    from .mtbench import load_mtbench

    if source not in SOURCES:
        raise typer.BadParameter(f"--heldout-source must be one of {SOURCES}, got {source!r}")
    sets: dict[str, list[tuple]] = {}
    for name in dict.fromkeys(wanted):
        if name == "mtbench":
            sets[name] = [(q.question_id, q.category, q) for q in load_mtbench(limit=limit)]
        else:
            kind = name.removeprefix("heldout-")
            try:
                picked = heldout_set(kind, heldout_n, source)
                # a follow-up is a conversation; its category is its kind (all of them come from ShareGPT)
                sets[name] = [(p.id, p.kind, p.messages()) if p.context else (p.id, p.source, p.text) for p in picked]
            except ModuleNotFoundError as err:  # ShareGPT not installed
                hint = "or use only the handwritten held-out prompts: --heldout-source handwritten"
                raise typer.BadParameter(f"{err} ({hint})") from err
    sets = {name: items for name, items in sets.items() if items}
    if not sets:
        raise typer.BadParameter("no prompts to run: every selected set is empty (--limit / --heldout-n)")
    return sets


# The methods whose speed depends on the head set: another head set (--extra-heads) runs these.
HEAD_METHODS = ("chain", "tree", "tree_lookup", "auto", "auto_packed", "auto_static_packed", "auto_compiled")


def _decoding_methods(mtp_model, wanted: list[str], tree: str) -> dict:
    """Our decoder under every requested method of its own (the baselines are built elsewhere), in request order.

    One prepacked and one compiled copy serve all methods that ask for them."""
    from mtp.cli import _parse_tree

    from .methods import ours, ours_one_token

    table, packed, compiled = {}, None, None
    for name in wanted:
        if name == "chain":
            table[name] = ours(mtp_model, "chain")
        elif name in ("tree", "tree_lookup"):
            table[name] = ours(mtp_model, _parse_tree(tree), prompt_lookup=name == "tree_lookup")
        elif name == "auto":
            table[name] = ours(mtp_model, None, prompt_lookup=True)
        elif name in ("plain_packed", "auto_packed", "auto_static_packed"):
            packed = packed or _packed(mtp_model)
            if name == "plain_packed":
                table[name] = ours_one_token(packed)
            else:  # auto_static_packed: the same policy with static tree shapes (no draft-time trees)
                table[name] = ours(packed, None if name == "auto_packed" else "auto-static", prompt_lookup=True)
        elif name in ("plain_compiled", "auto_compiled"):
            compiled = compiled or _compiled(mtp_model)
            one = name == "plain_compiled"
            table[name] = ours_one_token(compiled) if one else ours(compiled, None, prompt_lookup=True)
    return table


def _extra_head_methods(label: str, other, wanted: list[str], tree: str) -> dict:
    """Another head set under the requested methods that depend on heads (chain and tree if none is), packed
    or compiled where those are requested: each head set is compared with ours under the same runtime."""
    names = [m for m in wanted if m in HEAD_METHODS] or ["chain", "tree"]
    return {f"{label}-{name}": method for name, method in _decoding_methods(other, names, tree).items()}


def _packed(mtp_model):
    """The same model (shared weights and heads) decoding from prepacked weights; the other methods stay as they are."""
    import copy

    try:
        return copy.copy(mtp_model).pack_decoding()
    except ValueError as e:  # mtp.packed says what this CPU or dtype lacks
        raise typer.BadParameter(f"*_packed methods: {e}") from None


def _compiled(mtp_model):
    """The same model (shared weights and heads) with its verify steps compiled, graphs built before timing."""
    import copy

    from mtp.cli import _compile_decoding

    compiled = copy.copy(mtp_model)  # a shallow copy: the eager methods stay eager
    _compile_decoding(compiled, " (not timed)")
    return compiled


def _sampling_run(mtp_model, prompts, max_new: int, temperature: float) -> dict:
    """Sampled decoding, plain generate() vs ours, same prompts and seeds (outputs differ: only the
    distribution is the same, which tests/test_sampling.py proves)."""
    import torch

    totals = {"plain": [0.0, 0], "ours": [0.0, 0]}
    steps = accepted = 0
    for i, (_, _, ids) in enumerate(prompts):
        t0 = time.perf_counter()
        torch.manual_seed(i)
        seq = mtp_model.base_model.generate(ids, max_new_tokens=max_new, do_sample=True, temperature=temperature)
        totals["plain"][0] += time.perf_counter() - t0
        totals["plain"][1] += seq.shape[1] - ids.shape[1]
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(i)
        out = mtp_model.generate(
            ids, max_new_tokens=max_new, do_sample=True, temperature=temperature, generator=g,
            return_dict_in_generate=True,
        )  # fmt: skip
        totals["ours"][0] += time.perf_counter() - t0
        totals["ours"][1] += out.num_new_tokens
        steps += len(out.accepted_lengths)
        accepted += sum(out.accepted_lengths)
    plain_tps = totals["plain"][1] / totals["plain"][0]
    ours_tps = totals["ours"][1] / totals["ours"][0]
    return {
        "temperature": temperature,
        "plain_tokens_per_s": round(plain_tps, 2),
        "ours_tokens_per_s": round(ours_tps, 2),
        "speedup": round(ours_tps / plain_tps, 3),
        "tau": round(accepted / steps, 3) if steps else None,
    }


def _assistant(mtp_model, directory: str, layers: int, torch_dtype):
    from transformers import AutoModelForCausalLM

    from .methods import truncated_assistant

    if not directory:
        return truncated_assistant(mtp_model.base_model, layers)
    if not (Path(directory) / "config.json").is_file():
        raise typer.BadParameter(f"--assistant {directory}: no Hugging Face checkpoint (config.json) there")
    draft = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype).eval()
    if draft.get_output_embeddings().weight.shape[0] != mtp_model.info.vocab_size:
        raise typer.BadParameter(f"--assistant {directory}: its vocabulary differs from the model's")
    return draft


def _assistant_label(directory: str, layers: int) -> str:
    if not directory:
        return f"layer-skip: first {layers} layers of the base (untrained)"
    config = json.loads((Path(directory) / "config.json").read_text())
    picks = config.get("mtp_draft_layers")
    return f"distilled draft model {directory}: {config.get('num_hidden_layers')} layers (from base layers {picks})"


def _load(model: str, heads: str, torch_dtype):
    from transformers import AutoTokenizer

    from mtp import MTPModel
    from mtp.default_model import load_default_mtp

    if model == "default":
        mtp_model, tokenizer, _ = load_default_mtp(torch_dtype, heads or None)
        return mtp_model, tokenizer
    mtp_model = MTPModel.from_pretrained(model, torch_dtype=torch_dtype)
    return mtp_model, AutoTokenizer.from_pretrained(model)


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
