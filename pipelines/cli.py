"""`temper` command line.

    temper demo [--preset tiny] [--steps 300] [--out runs/demo]   train, save, reload, sample
    temper config show [--preset tiny] [-o key=value ...]           print the resolved config
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path


def _console():
    from rich.console import Console

    return Console()


def cmd_config_show(args) -> int:
    import configs

    try:
        cfg = configs.load(args.preset, args.override)
    except configs.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(cfg.model_dump(mode="json"), indent=2))
    return 0


def cmd_demo(args) -> int:
    """A real small job with the model until the pipeline lands: train the preset on a generated corpus
    for a bounded time, save an HF-layout checkpoint, reload it, check it, and sample from it."""
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    import configs
    from model import ByteTokenizer, Transformer, load_checkpoint, read_checkpoint_meta, save_checkpoint
    from model.generate import generate
    from trainers.data import generated_corpus, lm_batches, unigram_entropy
    from trainers.lm import train_lm

    con = _console()
    overrides = list(args.override)
    if args.steps is not None:
        overrides.append(f"train.max_steps={args.steps}")
    try:
        cfg = configs.load(args.preset, overrides)
    except configs.ConfigError as e:
        con.print(f"[red]error:[/red] {e}")
        return 2
    torch.manual_seed(cfg.seed)
    tok = ByteTokenizer()
    if cfg.model.vocab_size < tok.vocab_size:
        con.print(f"[red]error:[/red] model.vocab_size={cfg.model.vocab_size} < byte tokenizer's {tok.vocab_size}")
        return 2
    corpus = generated_corpus(4000, seed=cfg.seed)
    ids = tok.encode(corpus)
    h_uni = unigram_entropy(ids)
    model = Transformer(cfg.model)
    con.print(f"[bold]temper demo[/bold] · preset [cyan]{args.preset}[/cyan] · "
              f"{model.num_parameters() / 1e6:.2f}M parameters ({model.num_parameters(active=True) / 1e6:.2f}M active)"
              f" · corpus {len(ids):,} tokens, unigram entropy {h_uni:.3f} nats")

    hist = []
    t0 = time.perf_counter()
    with Progress(TextColumn("train"), BarColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=con, transient=True) as prog:
        task = prog.add_task("", total=cfg.train.max_steps)

        def on_step(st):
            hist.append(st)
            prog.update(task, completed=st.step,
                        description=f"step {st.step} loss {st.loss:.3f} mtp {st.mtp_loss:.3f}")

        train_lm(model, lm_batches(ids, cfg.train.seq_len, cfg.train.batch_size, seed=cfg.seed), cfg.train, on_step)
    train_s = time.perf_counter() - t0
    n_tok = sum(s.tokens for s in hist)

    out = Path(args.out)
    ckpt = save_checkpoint(model, out / "checkpoint", policy_version=1,
                           extra_meta={"preset": args.preset, "steps": len(hist)})
    meta = read_checkpoint_meta(ckpt)
    reloaded = load_checkpoint(ckpt)
    probe = next(lm_batches(ids, cfg.train.seq_len, 4, seed=cfg.seed + 1))[0]
    model.eval()
    with torch.no_grad():
        drift = (model(probe) - reloaded(probe)).abs().max().item()

    # sample: ask where an item is, from facts the model has never seen in this order
    rng = random.Random(cfg.seed + 7)
    from trainers.data import _ITEMS, _NAMES, _PLACES, _VERBS

    prompts, answers = [], []
    for _ in range(args.samples):
        item, place = rng.choice(_ITEMS), rng.choice(_PLACES)
        prompts.append(f"{rng.choice(_NAMES)} {rng.choice(_VERBS)} the {item} in the {place}. where is the {item}?")
        answers.append(f" the {place}.")
    gens = generate(reloaded, [tok.encode(p) for p in prompts], max_new_tokens=16,
                    stop_ids=[tok.encode("\n")[0]])
    texts = [tok.decode(g).split("\n")[0] for g in gens]
    correct = sum(t.strip() == a.strip() for t, a in zip(texts, answers))

    table = Table(title="temper demo: what ran")
    table.add_column("what")
    table.add_column("value", overflow="fold")
    n_indexers = cfg.model.layer_indexer_types().count("full")
    table.add_row("model", f"{cfg.model.model_type}, {cfg.model.num_hidden_layers} layers, "
                           f"{cfg.model.n_routed_experts} experts top-{cfg.model.num_experts_per_tok}, "
                           f"DSA top-{cfg.model.index_topk} ({n_indexers} indexers), "
                           f"{cfg.model.num_nextn_predict_layers} MTP layer")
    table.add_row("training", f"{len(hist)} steps, {n_tok:,} tokens in {train_s:.0f}s ({n_tok / train_s:,.0f} tok/s)")
    table.add_row("loss (nats/token)", f"{hist[0].loss:.3f} → {hist[-1].loss:.3f} (unigram entropy {h_uni:.3f})")
    table.add_row("MTP loss", f"{hist[0].mtp_loss:.3f} → {hist[-1].mtp_loss:.3f}")
    table.add_row("indexer KL", f"{hist[0].indexer_loss:.3f} → {hist[-1].indexer_loss:.3f}")
    size = sum(f.stat().st_size for f in ckpt.iterdir())
    ck_desc = f"{ckpt} ({size / 1e6:.1f} MB, {meta['checksum'][:19]}…, policy v{meta['policy_version']})"
    table.add_row("checkpoint", ck_desc)
    table.add_row("reload", f"max |Δlogit| = {drift:.2e}")
    table.add_row("samples", f"{correct}/{len(prompts)} answered correctly (greedy, cached decoding)")
    for p, t in list(zip(prompts, texts))[:3]:
        table.add_row("", f"{p}[green]{t}[/green]")
    con.print(table)
    con.print(f"next: load it with [cyan]model.load_checkpoint('{ckpt}')[/cyan] or in transformers "
              f"([cyan]GlmMoeDsaForCausalLM.from_pretrained[/cyan]).")
    return 0 if drift < 1e-4 else 1


def cmd_envs_generate(args) -> int:
    from envs.dataset import write_dataset
    from envs.generator import LLMGenerator, LLMUnavailable, generate

    con = _console()
    try:
        if args.llm_url:  # free-text patterns, written by a model behind an OpenAI-compatible endpoint
            if not args.pattern:
                con.print("[red]error:[/red] --llm-url needs at least one --pattern (free text)")
                return 2
            gen = LLMGenerator(args.llm_url, args.llm_model, api_key=os.environ.get("OPENAI_API_KEY"),
                               structured=not args.no_structured)
            specs = []
            for i in range(args.n):
                pat = args.pattern[i % len(args.pattern)]
                try:
                    specs.append(gen.generate(pat, seed=args.seed * 1_000_003 + i))
                except ValueError as e:  # one bad reply costs one spec; the gate judges the rest
                    con.print(f"[yellow]skipped[/yellow] {pat!r} #{i}: {e}")
            if not specs:
                con.print("[red]error:[/red] the model wrote no usable spec")
                return 1
        else:
            specs = generate(args.pattern or None, args.n, args.seed)
    except (KeyError, ValueError, ImportError) as e:
        con.print(f"[red]error:[/red] {e}")
        return 2
    except LLMUnavailable as e:
        con.print(f"[red]error:[/red] {e}")
        return 1
    man = write_dataset(specs, args.out, {"patterns": args.pattern, "seed": args.seed,
                                          **({"llm": {"url": args.llm_url, "model": args.llm_model}}
                                             if args.llm_url else {})})
    con.print(f"wrote {man['n']} specs to {args.out} (sha256 {man['sha256'][:16]}…): {man['families']}")
    return 0


def cmd_envs_validate(args) -> int:
    from rich.table import Table

    from envs.dataset import read_dataset, write_dataset
    from envs.gate import acceptance, validate
    from envs.sandbox import SandboxUnavailable, make_sandbox

    con = _console()
    try:
        specs = read_dataset(args.dataset)
        sandbox = make_sandbox(args.sandbox)
    except (FileNotFoundError, ValueError, SandboxUnavailable) as e:
        con.print(f"[red]error:[/red] {e}")
        return 2
    from concurrent.futures import ThreadPoolExecutor

    reports: list = [None] * len(specs)
    # each validation is mostly sandboxed subprocesses waiting on limits: run `--workers` at once
    from .progress import bar

    with bar(con) as prog, ThreadPoolExecutor(args.workers) as pool:  # k/N environments, elapsed, time left
        task = prog.add_task(f"validating ({args.workers} at once)", total=len(specs), note="")

        def one(i: int) -> None:
            reports[i] = validate(specs[i], sandbox, probes=not args.no_probes)
            prog.advance(task)

        list(pool.map(one, range(len(specs))))
    acc = acceptance(reports)
    table = Table(title=f"environment validation ({sandbox.name} sandbox)")
    for col in ("family", "accepted", "total", "rate", "rejections"):
        table.add_column(col)
    for fam, row in sorted(acc.items()):
        reasons = ", ".join(f"{k}×{v}" for k, v in row["reasons"].items()) or "-"
        table.add_row(fam, str(row["accepted"]), str(row["total"]), f"{row['accepted'] / row['total']:.0%}", reasons)
    con.print(table)
    out = Path(args.out or args.dataset)
    out.mkdir(parents=True, exist_ok=True)
    (out / "validation.json").write_text(json.dumps([r.to_dict() for r in reports], indent=1, default=str))
    ok = {r.id for r in reports if r.accepted}
    man = write_dataset([s for s in specs if s.id in ok], out / "accepted", {"validated_from": str(args.dataset)})
    con.print(f"{man['n']}/{len(specs)} accepted → {out / 'accepted'}; per-spec report in {out / 'validation.json'}")
    return 0


def cmd_envs_show(args) -> int:
    from envs.dataset import read_dataset

    specs = {s.id: s for s in read_dataset(args.dataset)}  # a missing dataset: FileNotFoundError, reported by main
    if args.id not in specs:
        print(f"error: no spec {args.id!r} in {args.dataset} (e.g. {', '.join(list(specs)[:3])})", file=sys.stderr)
        return 2
    s = specs[args.id]
    view = s.model_dump(mode="json") if args.reveal else {**s.public().model_dump(), "spec_hash": s.spec_hash,
                                                          "verifier_hash": s.verifier_hash,
                                                          "checks": [c.name for c in s.verifier.checks]}
    print(json.dumps(view, indent=2))
    return 0


def cmd_serve(args) -> int:
    import torch

    from rollout.server import serve

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: CUDA is not available on this machine (use --device cpu or auto)", file=sys.stderr)
        return 2
    if args.cuda_graphs and device != "cuda":
        print(f"error: --cuda-graphs needs --device cuda (the device is {device})", file=sys.stderr)
        return 2
    serve(args.checkpoint, host=args.host, port=args.port, n_slots=args.slots, max_len=args.max_len,
          spec_drafts=args.spec_drafts, device=device, dtype=args.dtype, cuda_graphs=args.cuda_graphs)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="temper", description="RL post-training of GLM-5-architecture models")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train the preset briefly, save, reload and sample")
    d.add_argument("--preset", default="tiny")
    d.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's train.max_steps)")
    d.add_argument("--out", default="runs/demo")
    d.add_argument("--samples", type=int, default=20)
    d.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    d.set_defaults(fn=cmd_demo)
    c = sub.add_parser("config", help="inspect configs")
    csub = c.add_subparsers(dest="sub", required=True)
    show = csub.add_parser("show", help="print the resolved config of a preset")
    show.add_argument("--preset", default="tiny")
    show.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    show.set_defaults(fn=cmd_config_show)
    e = sub.add_parser("envs", help="generate, validate and inspect environments")
    esub = e.add_subparsers(dest="sub", required=True)
    g = esub.add_parser("generate", help="generate specs from family patterns")
    g.add_argument("--pattern", action="append", default=[], help="family[?horizon=N]; repeatable (default: all)")
    g.add_argument("--n", type=int, default=14)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", default="runs/envs/generated")
    g.add_argument("--llm-url", default=None,
                   help="OpenAI-compatible endpoint (needs temper[llm]): patterns are free text the model turns into "
                        "tasks and verifiers; API key from OPENAI_API_KEY")
    g.add_argument("--llm-model", default="default", help="model name sent to --llm-url")
    g.add_argument("--no-structured", action="store_true",
                   help="do not ask for JSON-schema structured output (for servers without it, e.g. temper serve)")
    g.set_defaults(fn=cmd_envs_generate)
    v = esub.add_parser("validate", help="judge + triad + hack probes; writes the accepted subset")
    v.add_argument("dataset")
    v.add_argument("--sandbox", default="auto", choices=["auto", "bwrap", "docker", "unsafe-subprocess"])
    v.add_argument("--no-probes", action="store_true")
    v.add_argument("--workers", type=int, default=8, help="environments validated at once")
    v.add_argument("--out", default=None)
    v.set_defaults(fn=cmd_envs_validate)
    s = esub.add_parser("show", help="print one spec (public view unless --reveal)")
    s.add_argument("dataset")
    s.add_argument("id")
    s.add_argument("--reveal", action="store_true", help="include hidden state, reference and verifier")
    s.set_defaults(fn=cmd_envs_show)
    from .run_cli import add_parser as add_run
    from .train_cli import add_parser as add_train

    add_run(sub)
    add_train(sub)
    sv = sub.add_parser("serve", help="serve a checkpoint with the embedded engine (SGLang-compatible API)")
    sv.add_argument("--checkpoint", required=True)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=30000)
    sv.add_argument("--slots", type=int, default=16, help="concurrent sequences (cache slots)")
    sv.add_argument("--max-len", type=int, default=2048, help="context length per slot")
    sv.add_argument("--spec-drafts", type=int, default=0, help="MTP draft tokens per verify (0: off)")
    sv.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"],
                    help="where weights, cache and sampling live (auto: cuda when available)")
    sv.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="weights dtype (default: the checkpoint's)")
    sv.add_argument("--cuda-graphs", action="store_true", help="replay captured decode steps (CUDA, no --spec-drafts)")
    sv.set_defaults(fn=cmd_serve)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a re-launch under torchrun repeats
    if getattr(args, "workers", 1) < 1:
        p.error("--workers must be at least 1")
    import configs

    try:
        return args.fn(args)
    except configs.ConfigError as e:  # a config mistake: the key, the reason and a "did you mean", no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:  # a path mistake
        print(f"error: {e.filename or e}: no such file or directory" if e.filename else f"error: {e}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
