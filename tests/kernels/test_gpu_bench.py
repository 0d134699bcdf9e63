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


def test_card_peaks_are_the_card_that_ran():
    """Every '% of peak' divides by the card that ran: an SXM H100's HBM is 3,350 GB/s, not the H200's 4,800; a PCIe
    H100 is not an SXM one; a card not listed gets no peak rather than another card's."""
    sys.path.insert(0, str(ROOT / "bench"))
    import math

    from gpu_common import card_peaks

    assert card_peaks("NVIDIA H100 80GB HBM3") == (989.0, 3350.0)
    assert card_peaks("NVIDIA H200") == (989.0, 4800.0)
    assert card_peaks("NVIDIA H100 PCIe") == (756.0, 2000.0)
    assert all(math.isnan(x) for x in card_peaks("NVIDIA A100-SXM4-80GB"))


def test_figures_of_one_call_accumulate_across_its_parts(tmp_path):
    """bench/gpu_run.sh runs bench/gpu.py once per part into one gpu.json: a later part adds its sections and keeps
    the earlier part's (a part that started fresh would erase the kernel rows the decode part follows)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from common import Figures

    first = Figures("gpu.json")
    first.to(tmp_path)
    first.record("kernels", "sparse MLA forward", {"triton_ms": 1.5})
    first.record("seconds", "kernels", 10.0)
    second = Figures("gpu.json")
    second.to(tmp_path)
    second.record("decode", "batch1", {"temper_eager_tok_s": 7.0})
    second.record("seconds", "decode", 3.0)
    got = json.loads((tmp_path / "gpu.json").read_text())
    assert got == {"kernels": {"sparse MLA forward": {"triton_ms": 1.5}}, "decode": {"batch1": {"temper_eager_tok_s": 7.0}},
                   "seconds": {"kernels": 10.0, "decode": 3.0}}


def test_device_call_cuts_a_part_at_the_deadline_and_keeps_what_came_before(tmp_path):
    """bench/gpu_run.sh's `part` under a 6 s call deadline: a part that ends runs whole; one that would outlast the
    deadline (a 120 s cap, a 60 s sleep) is cut when the deadline comes, exit 124, keeping what it wrote; a part after
    the deadline is skipped and says so; every part's log is in logs.tgz, tarred after each part."""
    import tarfile

    script = f"""
        GPU_RUN_LIB=1 source {ROOT / 'bench/gpu_run.sh'}
        set +e; SECONDS=0; DEADLINE=6
        part first 30 bash -c 'echo first wrote > "$OUT/first.txt"'
        part slow 120 bash -c 'echo slow started > "$OUT/slow.txt"; sleep 60; echo never > "$OUT/slow.txt"'
        part last 30 bash -c 'echo never > "$OUT/last.txt"'
    """
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "OUT": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    parts = (tmp_path / "parts.txt").read_text().splitlines()
    assert parts[0].startswith("first: 6 s cap") and parts[0].endswith("exit 0"), parts  # the cap: what was left
    assert parts[1].startswith("slow: ") and parts[1].endswith("exit 124 (cut at its cap)"), parts
    assert int(parts[1].split(": ")[1].split(" s cap")[0]) <= 6, parts  # its cap was what was left of the deadline
    assert parts[2] == "last: skipped, the call's deadline is reached", parts
    assert (tmp_path / "first.txt").read_text() == "first wrote\n" and (tmp_path / "slow.txt").read_text() == (
        "slow started\n") and not (tmp_path / "last.txt").exists()
    with tarfile.open(tmp_path / "logs.tgz") as t:
        assert {Path(n).name for n in t.getnames() if n.endswith(".log")} == {"first.log", "slow.log"}
