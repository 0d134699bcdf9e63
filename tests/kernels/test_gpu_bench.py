"""bench/gpu.py stays runnable without a GPU: its --smoke mode runs the model, decode, parity and profile sections at toy shapes
(the kernel section's kernels are covered one by one in test_kernels.py) and writes figures, not errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_bench_smoke_writes_every_section(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench/gpu.py"), "--smoke", "--sections", "model", "decode", "parity",
                        "profile", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "gpu.json").read_text())
    assert not [s for s in ("model", "decode", "parity", "profile") if "error" in res.get(s, {})], res
    smoke = res["model"]["smoke"]
    assert smoke["temper_fwd_tok_s"] > 0 and smoke["max_abs_logit_diff_vs_hf"] < 1e-4  # same weights, same logits
    assert smoke["temper_ckpt_fwdbwd_tok_s"] > 0 and smoke["temper_fwdbwd_saved_gib_counted"] > 0
    assert res["decode"]["batch1"]["temper_eager_tok_s"] > 0
    assert res["decode"]["fp32_fidelity"]["eager_same_as_hf"] == "2/2"  # greedy tokens, engine vs generate
    assert res["parity"]["torch.float32"]["max_abs_logit"] == 0.0  # the same fp32 model on the same device
    assert res["parity"]["torch.bfloat16"]["max_abs_logit"] > 0.0
    top = res["profile"]["top"]
    assert 0 < sum(e["ms"] for e in top) <= res["profile"]["total_ms"] + 1e-6 and any("mm" in e["op"] for e in top)


@pytest.mark.slow
def test_megatron_gpu_bench_smoke_writes_every_section(tmp_path):
    """bench/megatron_gpu.py --smoke: fp32 parity within its aim, one SAO step's gradients alike, TP = 2 in its child
    process, and both backends timed."""
    r = subprocess.run([sys.executable, str(ROOT / "bench/megatron_gpu.py"), "--smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "megatron.json").read_text())
    assert not [s for s in ("parity", "sao", "tp2", "speed") if "error" in res.get(s, {})], res
    p = res["parity"]["float32 vs temper fp32"]
    assert max(p["loss_rel"], p["logits_rel"], p["mtp_logits_rel"]) <= 1e-5 and p["grad_rel_max"] <= 1e-4
    assert res["sao"]["fp32"]["updated"] and res["sao"]["fp32"]["grad_rel_max"] <= 1e-4
    assert res["tp2"]["tp2 ep1"]["logits_rel"] <= 1e-5 and res["tp2"]["tp2 ep1"]["grad_rel_max"] <= 1e-4
    assert res["speed"]["torch"]["fwd_bwd_tok_s"] > 0 and res["speed"]["megatron_over_torch"] > 0
    assert res["speed"]["megatron_sequential_over_torch"] > 0


def test_gpu_checks_smoke_compares_every_kernel_with_its_twin_and_measures_fp8(tmp_path):
    """bench/gpu_checks.py --smoke (what `bash bench/gpu_run.sh checks` runs at full size): the kernels that wrapped
    past 2³¹ elements (sparse MLA, rope, both grouped-GEMM offsets) under the interpreter against their twins on the
    checked rows, and the FP8 agreement rows, written to checks.json."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TEMPER_KERNELS")}
    r = subprocess.run([sys.executable, str(ROOT / "bench/gpu_checks.py"), "--smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "checks.json").read_text())
    rows = res["offsets"]
    assert len(rows) == 4 and all(row["ok"] for row in rows.values()), rows
    assert rows["sparse MLA fwd+bwd"]["dq_rest"] == 0.0 and 0 < rows["sparse MLA fwd+bwd"]["o"] < 1e-5  # the kernel
    assert set(res["fp8"]) == {"gaussian T32 S128 k16", "tiny-base"}
    assert all(0.5 < row["mean"] <= 1 and row["rows"] > 0 for row in res["fp8"].values()), res["fp8"]


def test_activation_memory_counts_each_saved_storage_once():
    """bench/activation_memory.py's accounting against a hand count: `x * w` saves both operands (512 B each in
    fp32), a second product of views of the same tensors saves no new storage, and `exp` saves its output."""
    sys.path.insert(0, str(ROOT / "bench"))
    import torch
    from activation_memory import saved_bytes

    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)

    def fn():
        y = (x * w).sum() + (x[:4] * w[4:]).sum()
        return y + x.exp().sum()

    total, by = saved_bytes(fn)
    assert total == 3 * 8 * 16 * 4 and sum(by.values()) == total


@pytest.mark.slow
def test_every_kernel_the_cuda_paths_launch_compiles_for_an_h200(tmp_path):
    """bench/triton_compile.py: each Triton kernel specialisation the CUDA paths launch (training forward+backward,
    the captured decode step, the FP8 indexer; tiny in fp32, GLM-5's shapes in bf16) compiled for sm_90 by
    Triton's compiler and ptxas, without a GPU, within the H200's shared memory. The interpreter the other kernel
    tests use accepts things the compiler does not; this is where those would show. At GLM-5's shapes (a 132K-token
    sequence, 16 × 4096 tokens, a 64 × 128K decode cache) no kernel's i32 address arithmetic may wrap: every kernel
    is checked, launch by launch (bench/ir_offsets.py)."""

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TEMPER_KERNELS")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compiled here, not taken from an earlier run's cache
    # (the 2B and 524M configs: the same kernels, at GLM-5's MLA widths, with other norm and MLP blocks)
    r = subprocess.run([sys.executable, str(ROOT / "bench/triton_compile.py"), "--sizes", "glm5"], capture_output=True,
                       text=True, timeout=900, cwd=ROOT, env=env)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-2000:])
    assert "specialisations, 0 failed" in r.stdout
    kernels = ("_fwd_kernel", "_combine_kernel", "_bwd_ds_kernel", "_bwd_dq_kernel", "_bwd_dkv_kernel", "_scores_kernel",
               "_topk_block_kernel", "_topk_merge_kernel", "_gmm_kernel", "_gmm_dw_kernel", "_route_kernel", "_swiglu_fwd",
               "_swiglu_bwd", "_rms_fwd", "_rms_bwd", "_rope_kernel")
    for kernel in kernels:
        assert kernel in r.stdout, kernel
    offsets = [line for line in r.stdout.splitlines() if line.startswith("offsets at GLM-5 shapes:")]
    assert len(offsets) == 1 and offsets[0].endswith("; 0 wrap"), offsets
    assert set(kernels) <= set(offsets[0].split("kernels ")[1].split(";")[0].split()), offsets


def test_activation_memory_bench_runs_and_chunks_keep_less():
    """bench/activation_memory.py end to end at a short length: each pass's count through chunks is below the
    whole-logits one (the saving is the logits' log-softmax, which grows with the vocabulary and the length)."""
    r = subprocess.run([sys.executable, str(ROOT / "bench/activation_memory.py"), "--sizes", "524M", "--seq", "1024"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line.split("│")[1:-1] for line in r.stdout.splitlines() if line.count("│") >= 6 and "524M" in line]
    rows = [[c.strip() for c in row] for row in rows if "×" in row[4]]
    assert len(rows) == 2, r.stdout
    for _, _, whole, chunked, *_ in rows:
        assert 0 < float(chunked) < float(whole)
