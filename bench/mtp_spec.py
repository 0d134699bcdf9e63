"""MTP speculative decoding at batch 1: accept length (tokens per verify) with 5 drafts and the speed-up
over plain decoding, on the `tiny` model trained with the MTP loss (3 chained draft steps) on the
generated corpus. Run: .venv/bin/python bench/mtp_spec.py [--train-steps 400]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import table, threads

import configs
from model import ByteTokenizer, Transformer
from rollout.engine import Engine
from rollout.sampling import SamplingParams
from trainers.data import generated_corpus, lm_batches
from trainers.lm import train_lm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-steps", type=int, default=400)
    ap.add_argument("--drafts", type=int, default=5)
    ap.add_argument("--new", type=int, default=120)
    ap.add_argument("--prompts", type=int, default=6)
    args = ap.parse_args()
    cfg = configs.load("tiny", [f"train.max_steps={args.train_steps}", "train.mtp_loss_weight=1.0",
                                "model.mtp_draft_steps=3"])
    torch.manual_seed(0)
    tok = ByteTokenizer()
    model = Transformer(cfg.model)
    hist = train_lm(model, lm_batches(tok.encode(generated_corpus(4000)), cfg.train.seq_len, cfg.train.batch_size),
                    cfg.train)
    model.eval()
    prompts = [tok.encode(line[:20]) for line in generated_corpus(args.prompts, seed=42).splitlines()]
    sp = SamplingParams(max_new_tokens=args.new, temperature=0, ignore_eos=True)
    rows, outs = [], {}
    for drafts in (0, args.drafts):
        eng = Engine(model, n_slots=1, max_len=256, start=False, spec_drafts=drafts)
        eng.generate(prompts[0], params=sp.model_copy(update={"max_new_tokens": 8}))  # warm-up
        eng.stats.spec_verifies = eng.stats.spec_emitted = 0
        t = time.perf_counter()
        outs[drafts] = [eng.generate(p, params=sp.model_copy()).output_ids for p in prompts]
        dt = time.perf_counter() - t
        n = sum(len(o) for o in outs[drafts])
        rows.append([drafts, f"{n / dt:,.0f}", f"{eng.stats.accept_length:.2f}" if drafts else "1 (no drafts)", dt])
    base = rows[0][3]
    for r in rows:
        r.append(base / r[3])
        r[3] = f"{r[3]:.2f}"
    same = outs[0] == outs[args.drafts]
    table(f"batch 1 greedy, {args.new} tokens × {len(prompts)} prompts, tiny after {len(hist)} steps "
          f"(MTP loss {hist[-1].mtp_loss:.3f}), {threads()} threads — outputs identical: {same}",
          ["drafts", "tokens/s", "tokens per verify", "seconds", "speed-up"], rows)


if __name__ == "__main__":
    main()
