"""The learning benches' own parts: fresh held-out sets are disjoint from every set the project uses, and the copy
bench's digit score counts what it says."""

import importlib
import sys
from pathlib import Path

import torch

import configs
from envs.generator import task_content
from model import ByteTokenizer
from stages.env_sets import base_recipe_contents, held_out
from trainers.synthetic import synthetic_segments

BENCH = str(Path(__file__).resolve().parents[1] / "bench")


def _bench(name: str):
    """A bench script as a module (they import their `common` from bench/, as when run)."""
    if BENCH not in sys.path:
        sys.path.append(BENCH)
    return importlib.import_module(name)


def test_fresh_held_out_sets_share_no_task_with_the_held_out_set_the_base_recipe_or_each_other():
    cfg = configs.load("tiny", ["envs.n_eval=48"])
    sets = _bench("fresh_held_out").fresh_sets(cfg, [1, 2])
    held = {task_content(s) for s in held_out(cfg.envs, cfg.base)[0]}
    base = set(base_recipe_contents(cfg.base))
    c1, c2 = ({task_content(s) for s in sets[k]} for k in (1, 2))
    assert len(c1) == len(sets[1]) == 48 and len(c2) == 48  # no task twice within a set
    assert not (c1 & held) and not (c2 & held) and not (c1 & base) and not (c2 & base) and not (c1 & c2)
    # every held-out pattern keeps its share
    assert sorted({s.family for s in sets[1]}) == sorted({s.family for s in held_out(cfg.envs, cfg.base)[0]})


class _Oracle(torch.nn.Module):
    """Logits that put all mass on the true next token, or on the token `shift` positions later."""

    def __init__(self, shift: int = 0):
        super().__init__()
        self.shift = shift

    def forward(self, ids):
        nxt = torch.roll(ids, -1 - self.shift, dims=1)
        return torch.nn.functional.one_hot(nxt, 272).float()


def test_digit_accuracy_scores_only_trained_digits():
    tok = ByteTokenizer()
    segs = synthetic_segments("echo", 40, 0, tok)
    from trainers.sft import pad_segments

    ids, mask = pad_segments(segs, 256)
    digit_accuracy = _bench("copy_drills").digit_accuracy
    assert digit_accuracy(_Oracle(), segs, 256) == 1.0
    wrong = digit_accuracy(_Oracle(shift=1), segs, 256)  # predicts the token after next: right only on repeats
    tgt, m = ids[:, 1:], mask[:, 1:]
    digits = (tgt >= 48) & (tgt <= 57) & m
    want = ((torch.roll(ids, -2, dims=1)[:, :-1] == tgt) & digits).sum().item() / digits.sum().item()
    assert wrong == want < 0.5


def test_the_reference_decoder_is_causal():
    torch.manual_seed(0)
    ref = _bench("copy_drills").Reference(272, 32, 2, 4).eval()
    a = torch.randint(0, 256, (1, 12))
    b = a.clone()
    b[0, 8:] = (b[0, 8:] + 1) % 256  # change the future
    with torch.no_grad():
        torch.testing.assert_close(ref(a)[:, :8], ref(b)[:, :8])
        assert not torch.allclose(ref(a)[:, 8:], ref(b)[:, 8:])


def test_the_mha_swap_keeps_temper_causal():
    """`--temper-attention mha` compares attention kinds only if the swapped model still cannot see the future."""
    from model import Transformer

    cfg = configs.load("micro").model
    torch.manual_seed(0)
    m = Transformer(cfg).eval()
    for layer in m.layers:
        layer.self_attn = _bench("copy_drills").CausalMHA(cfg.hidden_size, cfg.num_attention_heads)
    a = torch.randint(0, 256, (2, 12))
    b = a.clone()
    b[:, 8:] = (b[:, 8:] + 1) % 256
    with torch.no_grad():
        torch.testing.assert_close(m(a)[:, :8], m(b)[:, :8])
        assert not torch.allclose(m(a)[:, 8:], m(b)[:, 8:])
