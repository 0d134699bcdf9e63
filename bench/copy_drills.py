"""How fast a model learns to copy: temper's tiny model against a plain decoder of the same size, from scratch.

    python bench/copy_drills.py --steps 600 --lr 1e-3
    python bench/copy_drills.py -o model.initializer_range=0.08 -o model.first_k_dense_replace=4

Every value a tiny agent submits is copied: from the prompt into `calc`, from a file into `submit`, from the
instruction into `replace`. The base recipe's byte drills (`trainers/synthetic.py`) train that skill alone: `echo`
copies a span, `recall` looks a key's value up among 2–5 pairs. Both models below see the same drill batches
(`--batch` sequences a step, drawn from one seeded stream) for `--steps` AdamW steps at `--lr`, in this process:

- **temper**: the preset's model (`-o model.KEY=VALUE` changes it), GLM-5's architecture (MLA, MoE, DSA, RoPE);
- **reference**: `torch.nn.TransformerEncoder` as a causal decoder, the same width, depth and heads, a learned
  absolute position embedding (`--reference-positions none`: without one), pre-norm, a GELU MLP of 4× width.

The table gives each model's share of target digits predicted right (teacher-forced argmax on 200 held-out drill
sequences per kind) at evenly spaced steps, and the ratio temper ÷ reference. The tiny base's in-task copy errors
(`bench/math_levers.py`) are what a low `recall` share looks like inside an episode.
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn as nn
from common import table

from configs import load

KINDS = ("echo", "recall")


class Reference(nn.Module):
    """A plain pre-norm causal decoder from torch.nn's own layers."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, max_len: int = 512, positions: bool = True):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d) if positions else None
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        x = self.emb(ids) + (self.pos(torch.arange(t)) if self.pos is not None else 0)  # none: order from the mask alone
        return self.head(self.norm(self.enc(x, mask=mask, is_causal=True)))


class CausalMHA(nn.Module):
    """Plain multi-head attention in place of one of temper's MLA layers (`--temper-attention mha`): the same call
    and return as `MLA.forward` for a cache-free forward, so one part of the model is swapped and the rest is kept."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, bias=False, batch_first=True)

    def forward(self, x: torch.Tensor, ctx, shared_sel=None):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.attn(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0], None


def digit_accuracy(model: nn.Module, segs: list, pad_id: int) -> float:
    """Share of trained digit tokens whose teacher-forced argmax is right."""
    from trainers.sft import pad_segments

    ids, mask = pad_segments(segs, pad_id)
    was = model.training
    model.eval()
    with torch.no_grad():
        pred = model(ids)[:, :-1].argmax(-1)
    model.train(was)
    tgt, m = ids[:, 1:], mask[:, 1:]
    digits = (tgt >= ord("0")) & (tgt <= ord("9")) & m
    return ((pred == tgt) & digits).sum().item() / max(1, digits.sum().item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--points", type=int, default=3, help="evaluations over the run")
    ap.add_argument("--reference-positions", choices=("learned", "none"), default="learned",
                    help="the reference's position embedding (none: a causal decoder without one)")
    ap.add_argument("--temper-attention", choices=("mla", "mha"), default="mla",
                    help="mha: every MLA layer of temper's model replaced by plain causal multi-head attention")
    ap.add_argument("--temper-embed-std", type=float, default=None,
                    help="re-initialise temper's token embedding at this std (torch.nn.Embedding's default is 1)")
    ap.add_argument("-o", "--override", action="append", default=[])
    a = ap.parse_args()

    from model import ByteTokenizer, Transformer
    from trainers.sft import pad_segments
    from trainers.synthetic import synthetic_segments

    cfg = load(a.preset, a.override).model
    tok = ByteTokenizer()
    pool = [s for k in KINDS for s in synthetic_segments(k, 4000, 1, tok)]
    test = {k: synthetic_segments(k, 200, 999, tok) for k in KINDS}
    torch.manual_seed(0)
    models = {"temper": Transformer(cfg)}
    if a.temper_attention == "mha":
        for layer in models["temper"].layers:
            layer.self_attn = CausalMHA(cfg.hidden_size, cfg.num_attention_heads)
    if a.temper_embed_std is not None:
        nn.init.normal_(models["temper"].embed_tokens.weight, std=a.temper_embed_std)
    torch.manual_seed(0)  # the reference's weights do not depend on the temper configuration's size
    models["reference"] = Reference(cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                                    positions=a.reference_positions == "learned")
    opts = {n: torch.optim.AdamW(m.parameters(), lr=a.lr, weight_decay=0.0) for n, m in models.items()}
    rng = random.Random(0)
    every = max(1, a.steps // a.points)
    rows, pad = [], cfg.pad_token_id or 0
    for step in range(1, a.steps + 1):
        ids, mask = pad_segments([pool[rng.randrange(len(pool))] for _ in range(a.batch)], pad)
        tgt, m = ids[:, 1:], mask[:, 1:]
        for n, model in models.items():
            logits = model(ids)[:, :-1]
            loss = nn.functional.cross_entropy(logits[m].float(), tgt[m])
            opts[n].zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opts[n].step()
        if step % every == 0 or step == a.steps:
            acc = {n: {k: digit_accuracy(model, test[k], pad) for k in KINDS} for n, model in models.items()}
            for k in KINDS:
                t, r = acc["temper"][k], acc["reference"][k]
                rows.append([step, k, f"{t:.2f}", f"{r:.2f}", f"{t / r:.2f}" if r else "–"])
    params = {n: sum(p.numel() for p in m.parameters()) for n, m in models.items()}
    table(f"copy drills from scratch: digits right, teacher-forced ({a.batch} sequences a step, lr {a.lr}; parameters "
          f"temper {params['temper']:,}, reference {params['reference']:,})",
          ["step", "drill", "temper", "reference", "temper ÷ reference"], rows)


if __name__ == "__main__":
    main()
