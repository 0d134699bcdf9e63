"""Shared helpers for the benchmarks: timing, a ratio table and a progress bar."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def progress(description: str, total: int | None = None):
    """A progress bar on stderr for a bench's long work (k/N, elapsed, time left; `pipelines.progress.counting`): the
    tables stay on stdout, and a piped stderr draws nothing."""
    from rich.console import Console

    from pipelines.progress import counting

    return counting(Console(stderr=True), description, total)


def timeit(fn: Callable[[], object], repeat: int = 3, warmup: int = 1) -> float:
    """Median wall seconds of `fn()` over `repeat` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def table(title: str, header: list[str], rows: list[list[object]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for h in header:
        t.add_column(h, justify="right")
    for r in rows:
        t.add_row(*[f"{x:,.3f}" if isinstance(x, float) else str(x) for x in r])
    Console(width=None if sys.stdout.isatty() else 160).print(t)  # piped output: no wrapping at 80 columns


def threads() -> int:
    return torch.get_num_threads()


def reference_glm_config(**kw):
    """REFERENCE.md's baseline: hidden 128, 4 layers, 8 experts top-2, "FSSS" indexers (transformers config)."""
    from transformers import GlmMoeDsaConfig

    base = dict(
        vocab_size=272, hidden_size=128, intermediate_size=384, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
        kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        index_topk=64, index_head_dim=32, index_n_heads=4, first_k_dense_replace=1,
        indexer_types=["full", "shared", "shared", "shared"], max_position_embeddings=4096,
    )
    return GlmMoeDsaConfig(**{**base, **kw})


class Figures:
    """The figures of a device bench, rewritten to `<out>/<file>` after every record, so a run cut short keeps
    what it measured."""

    def __init__(self, file: str):
        self.file, self.data, self.out = file, {}, None

    def to(self, out: str | Path | None) -> None:
        """Write to `out`; figures already there (an earlier part of the same device call, bench/gpu_run.sh) are kept
        and added to, section by section."""
        import json

        if out:
            self.out = Path(out)
            self.out.mkdir(parents=True, exist_ok=True)
            f = self.out / self.file
            if f.exists():
                for section, values in json.loads(f.read_text()).items():
                    self.data.setdefault(section, {}).update(values if isinstance(values, dict) else {})

    def run(self, sections: dict[str, Callable[[], object]], names: list[str]) -> None:
        """Run the named sections in order; one that raises records its error and lets the others run (a section's
        failure must not lose the others' figures). Each section's seconds are recorded too."""
        import traceback

        for name in names:
            t0 = time.perf_counter()
            try:
                sections[name]()
            except Exception as e:
                traceback.print_exc()
                self.record(name, "error", f"{type(e).__name__}: {e}")
            self.record("seconds", name, round(time.perf_counter() - t0, 1))
            print(f"[{name}: {time.perf_counter() - t0:.1f} s]", flush=True)

    def record(self, section: str, key: str, value) -> None:
        import json

        self.data.setdefault(section, {})[key] = value
        if self.out is not None:
            (self.out / self.file).write_text(json.dumps(self.data, indent=1, default=str))


def md_table(title: str, header: list[str], rows: list[list]) -> None:
    """A Markdown table on stdout (what the device benches print: it pastes into the README)."""
    print(f"\n## {title}")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(f"{x:,.3g}" if isinstance(x, float) else str(x) for x in r) + " |")
    sys.stdout.flush()
