"""HF-layout checkpoints: `config.json` + safetensors (sharded with `model.safetensors.index.json`).

Names follow transformers / SGLang for `glm_moe_dsa` and `deepseek_v32`: prefix `model.`, routed
experts one by one (`mlp.experts.E.{gate,up,down}_proj.weight`), the MTP layers as
`model.layers.{num_hidden_layers + j}` with `enorm`, `hnorm`, `eh_proj`, a full block and
`shared_head.norm`. FP8 block-scaled weights (`weight_scale_inv`) are dequantised on load.
`temper.json` beside them carries the policy version, a content checksum and each weight file's sha256;
`load_checkpoint` verifies them (hashing each file once, streaming, files in parallel) and refuses a corrupt file
with `ChecksumError` naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig
from .transformer import Transformer

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
META_FILE = "temper.json"
FP32_KEYS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


# ---- name mapping ------------------------------------------------------------------------------------
def to_hf_state(model: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) for every persistent tensor of the model (a model kept in another layout, such as
    the Megatron trainer's, gives its own `hf_state()`)."""
    if hasattr(model, "hf_state"):
        yield from model.hf_state().items()
        return
    L = model.config.num_hidden_layers
    for name, t in model.state_dict().items():
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        m = re.match(r"mtp_layers\.(\d+)\.(.*)", name)
        if m:
            j, rest = int(m.group(1)), m.group(2)
            rest = rest.removeprefix("block.")
            rest = "shared_head.norm.weight" if rest == "shared_head_norm.weight" else rest
            name = f"layers.{L + j}.{rest}"
        if name.endswith("mlp.experts.gate_up_proj"):
            base = "model." + name.removesuffix("gate_up_proj")
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{base}{e}.gate_proj.weight", t[e, :inter]
                yield f"{base}{e}.up_proj.weight", t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            base = "model." + name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                yield f"{base}{e}.down_proj.weight", t[e]
        elif name == "lm_head.weight":
            yield name, t
        else:
            yield "model." + name, t


_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _check_mtp_copy(cfg: ModelConfig, tensors: dict[str, torch.Tensor], j: int, rest: str, t: torch.Tensor) -> None:
    """An MTP layer's own `embed_tokens` / `shared_head.head` (DeepSeek-V3 and GLM-5 save copies; Megatron trains one
    shared tensor): temper's MTP layers use the main embedding and head, so a copy loads only if it is the main tensor
    bit for bit; one that differs is refused with the reason, never dropped."""
    main = "model.embed_tokens.weight" if rest == "embed_tokens.weight" or cfg.tie_word_embeddings else "lm_head.weight"
    ref = tensors.get(main, tensors.get(main.removeprefix("model.")))
    if ref is None:
        return  # the main tensor is missing: the load reports it
    if ref.shape != t.shape or not torch.equal(ref, t.to(ref.dtype)):
        diff = "shape " + str(tuple(t.shape)) if ref.shape != t.shape else \
            f"max |diff| {(ref.float() - t.float()).abs().max().item():.3g}"
        raise ValueError(f"model.layers.{cfg.num_hidden_layers + j}.{rest}: MTP layer {j}'s own copy differs from "
                         f"{main} ({diff}); temper's MTP layers share the main embedding and head, so loading this "
                         "checkpoint would silently change its MTP drafts: refused")


def from_hf_state(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map HF names to this model's state-dict names, stacking per-expert weights."""
    L = cfg.num_hidden_layers
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        if name.startswith("model."):
            name = name[len("model.") :]
        m = re.match(r"layers\.(\d+)\.(.*)", name)
        if m and int(m.group(1)) >= L:
            j, rest = int(m.group(1)) - L, m.group(2)
            if j >= cfg.num_nextn_predict_layers:
                n_mtp = cfg.num_nextn_predict_layers
                raise KeyError(f"checkpoint has MTP layer {j} but num_nextn_predict_layers={n_mtp}")
            if rest in ("embed_tokens.weight", "shared_head.head.weight"):
                _check_mtp_copy(cfg, tensors, j, rest, t)
                continue  # a copy of the main embedding / head, which this model's MTP layers share
            if rest in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
                name = f"mtp_layers.{j}.{rest}"
            elif rest == "shared_head.norm.weight":
                name = f"mtp_layers.{j}.shared_head_norm.weight"
            else:
                name = f"mtp_layers.{j}.block.{rest}"
        em = _EXPERT.match(name)
        if em:
            experts.setdefault(em.group(1), {}).setdefault(int(em.group(2)), {})[em.group(3)] = t
            continue
        out[name] = t
    for base, per in experts.items():
        n = cfg.n_routed_experts
        missing = [e for e in range(n) if set(per.get(e, {})) != {"gate_proj", "up_proj", "down_proj"}]
        if missing:
            raise KeyError(f"{base}: incomplete experts {missing[:8]}")
        out[f"{base}.gate_up_proj"] = torch.stack(
            [torch.cat([per[e]["gate_proj"], per[e]["up_proj"]], 0) for e in range(n)]
        )
        out[f"{base}.down_proj"] = torch.stack([per[e]["down_proj"] for e in range(n)])
    return out


# ---- FP8 ---------------------------------------------------------------------------------------------
def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """W = fp8 · scale_inv, one scale per (block[0] × block[1]) tile."""
    out_f, in_f = w.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:out_f].repeat_interleave(block[1], 1)[:, :in_f]
    return w.float() * s


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled e4m3 quantisation (the layout of DeepSeek/GLM FP8 releases): (fp8 weight, scale_inv)."""
    out_f, in_f = w.shape
    rb, cb = -(-out_f // block[0]), -(-in_f // block[1])
    pad = torch.zeros(rb * block[0], cb * block[1], dtype=torch.float32)
    pad[:out_f, :in_f] = w.float()
    tiles = pad.view(rb, block[0], cb, block[1])
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (tiles / scale_inv[:, None, :, None]).view_as(pad)[:out_f, :in_f].to(torch.float8_e4m3fn)
    return q, scale_inv


# ---- save --------------------------------------------------------------------------------------------
def save_checkpoint(
    model: Transformer,
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 4 << 30,
    policy_version: int = 0,
    extra_meta: dict | None = None,
) -> Path:
    """Write `model` as an HF-layout directory, atomically (temp dir + fsync + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dtype = dtype or (torch.bfloat16 if model.config.dtype == "bfloat16" else torch.float32)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in to_hf_state(model):
        target = torch.float32 if name.endswith(FP32_KEYS) else dtype
        tensors[name] = t.detach().to("cpu", target).contiguous()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nb = t.numel() * t.element_size()
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nb
    cfg_dict = model.config.to_hf_dict()
    for caveat in model.config.transformers_caveats():  # a layout transformers would load wrongly: said at save
        warnings.warn(f"{path}: {caveat}", stacklevel=2)
    cfg_dict["dtype"] = "bfloat16" if dtype == torch.bfloat16 else "float32"
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        files = []
        if len(shards) == 1:
            files.append(SINGLE_FILE)
            save_file(shards[0], tmp / SINGLE_FILE, metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, sh in enumerate(shards):
                fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(sh, tmp / fn, metadata={"format": "pt"})
                files.append(fn)
                weight_map.update(dict.fromkeys(sh, fn))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2))
        total_sum, per_file = _checksums(tmp, files)
        meta = {"policy_version": policy_version, "checksum": total_sum, "files": per_file, **(extra_meta or {})}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def weights_checksum(model: torch.nn.Module) -> str:
    """sha256 over the state dict (names and bytes, in order): what a weight push checks on every engine."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + h.hexdigest()[:32]


def replace_dir(tmp: Path, final: Path) -> None:
    """Put a fully written directory in place of `final` by renames (the old one is removed after)."""
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)


CHUNK = 8 << 20  # hashing reads this much at a time: streaming, never a whole shard in memory


class ChecksumError(ValueError):
    """A checkpoint file whose bytes differ from the checksum recorded when it was saved (corrupt, truncated,
    overwritten): refused, naming the file."""


def _checksums(root: Path, files: list[str]) -> tuple[str, dict[str, str]]:
    """One pass over `files` in order: the checkpoint's checksum (sha256 of their bytes in that order) and each file's."""
    total = hashlib.sha256()
    per = {}
    for fn in files:
        h = hashlib.sha256()
        with open(root / fn, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                total.update(chunk)
        per[fn] = "sha256:" + h.hexdigest()
    return "sha256:" + total.hexdigest(), per


def file_sha256(path: str | os.PathLike) -> str:
    """"sha256:<hex>" of one file, read in chunks (hashlib releases the GIL on them: files hash in parallel)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def verify_files(root: str | os.PathLike, sums: dict[str, str], what: str = "checkpoint") -> int:
    """Check every `root/name` against `sums[name]` (files hashed in parallel, each once); ChecksumError naming the
    first file that differs or is missing. Returns the bytes read."""
    from concurrent.futures import ThreadPoolExecutor

    root = Path(root)
    missing = [fn for fn in sums if not (root / fn).is_file()]
    if missing:
        raise ChecksumError(f"{root / missing[0]}: missing, but the {what} records its checksum")
    with ThreadPoolExecutor(max(1, min(len(sums), os.cpu_count() or 1, 8))) as pool:
        got = dict(zip(sums, pool.map(lambda fn: file_sha256(root / fn), sums)))
    for fn, want in sums.items():
        if got[fn] != want:
            raise ChecksumError(f"{root / fn}: its bytes do not match the checksum the {what} recorded when it was "
                                f"saved (corrupt or truncated): {got[fn][:23]}… vs {want[:23]}…; refusing to load it")
    return sum((root / fn).stat().st_size for fn in sums)


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check a checkpoint's weight files against the checksums in its `temper.json` (each file's where recorded, else
    the whole checkpoint's); ChecksumError naming the file that differs. A checkpoint without recorded checksums (one
    imported from the hub) passes unchecked: "checked" False says so (an engine's weight update refuses it unless
    told to trust it). Returns {"checked": bool, "files": n, "bytes": n, "seconds": s}."""
    import time

    t0 = time.perf_counter()
    path = Path(path)
    meta = read_checkpoint_meta(path) if (path / META_FILE).exists() else {}
    if meta.get("files"):
        n = verify_files(path, meta["files"])
        return {"checked": True, "files": len(meta["files"]), "bytes": n, "seconds": time.perf_counter() - t0}
    if not meta.get("checksum"):
        return {"checked": False, "files": 0, "bytes": 0, "seconds": 0.0}
    files = _weight_files(path)
    got, _ = _checksums(path, files)
    if got != meta["checksum"]:
        names = ", ".join(str(path / fn) for fn in files)
        raise ChecksumError(f"{names}: the weights do not match the checksum recorded in {path / META_FILE} (corrupt "
                            "or truncated); refusing to load them")
    return {"checked": True, "files": len(files), "bytes": sum((path / fn).stat().st_size for fn in files),
            "seconds": time.perf_counter() - t0}


# ---- load --------------------------------------------------------------------------------------------
def read_checkpoint_meta(path: str | os.PathLike) -> dict:
    """What `temper.json` records (policy version, checksums); {} without one (a checkpoint from the hub or another
    tool): no version is made up for it — a default of 0 once put an updated engine back to version 0, silently."""
    p = Path(path) / META_FILE
    return json.loads(p.read_text()) if p.exists() else {}


def load_config(path: str | os.PathLike) -> ModelConfig:
    p = Path(path) / "config.json"
    if not p.exists():
        raise FileNotFoundError(f"{path}: no config.json (not an HF-layout checkpoint directory)")
    return ModelConfig.from_hf_dict(json.loads(p.read_text()))


def _weight_files(path: Path) -> list[str]:
    if (path / INDEX_FILE).exists():
        return sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values()))
    if (path / SINGLE_FILE).exists():
        return [SINGLE_FILE]
    files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no safetensors files")
    return files


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = _weight_files(path)
    out: dict[str, torch.Tensor] = {}
    for fn in files:
        with safe_open(path / fn, framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                out[k] = f.get_tensor(k)
    return out


def load_checkpoint(
    path: str | os.PathLike, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
    verify: bool = True,
) -> Transformer:
    """Load an HF-layout `glm_moe_dsa` / `deepseek_v32` directory into a `Transformer`. With `verify` (the default)
    its weight files are first checked against the checksums its `temper.json` recorded (`verify_checkpoint`): a
    corrupt file is refused with ChecksumError naming it. `verify=False` only where the caller has just verified
    the same files."""
    path = Path(path)
    cfg = load_config(path)
    if verify:
        verify_checkpoint(path)
    raw = json.loads((path / "config.json").read_text())
    block = tuple((raw.get("quantization_config") or {}).get("weight_block_size") or (128, 128))
    dtype = dtype or (torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32)
    tensors = _read_tensors(path)
    for name in [n for n in tensors if n.endswith("_scale_inv")]:
        wname = name.removesuffix("_scale_inv")
        tensors[wname] = dequantize_fp8(tensors[wname], tensors.pop(name), block)
    return model_from_hf_tensors(cfg, tensors, dtype=dtype, device=device, source=str(path))


def model_from_hf_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype,
                          device: str | torch.device = "cpu", source: str = "tensors") -> Transformer:
    """A `Transformer` of `cfg` from HF-named tensors (a checkpoint's files, or a transformers model's state dict
    held in memory): the names and shapes checked against the config, the router's gate and bias kept in fp32, the
    rest cast to `dtype` on `device`. `source` names the tensors in errors."""
    sd = from_hf_state(cfg, tensors)
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(sd) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    unexpected = sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise KeyError(
            f"{source}: checkpoint does not match config: missing {missing[:10]}, unexpected {unexpected[:10]}"
        )
    for name, ref in expected.items():
        if name in sd and tuple(sd[name].shape) != tuple(ref.shape):
            raise ValueError(f"{source}: {name} has shape {tuple(sd[name].shape)}, config implies {tuple(ref.shape)}")
    sd = {k: v.to(device, torch.float32 if k.endswith(("gate.weight", "e_score_correction_bias")) else dtype)
          for k, v in sd.items()}
    model.load_state_dict(sd, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.materialize_buffers(device)
    return model.eval()
