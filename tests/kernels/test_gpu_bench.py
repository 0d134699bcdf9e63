"""bench/gpu.py stays runnable without a GPU: its --smoke mode runs the model, decode and parity sections at toy shapes
(the kernel section's kernels are covered one by one in test_kernels.py) and writes figures, not errors."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_bench_smoke_writes_every_section(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench/gpu.py"), "--smoke", "--sections", "model", "decode", "parity",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "gpu.json").read_text())
    assert not [s for s in ("model", "decode", "parity") if "error" in res.get(s, {})], res
    smoke = res["model"]["smoke"]
    assert smoke["temper_fwd_tok_s"] > 0 and smoke["max_abs_logit_diff_vs_hf"] < 1e-4  # same weights, same logits
    assert res["decode"]["batch1"]["temper_eager_tok_s"] > 0
    assert res["parity"]["torch.float32"]["max_abs_logit"] == 0.0  # the same fp32 model on the same device
    assert res["parity"]["torch.bfloat16"]["max_abs_logit"] > 0.0
