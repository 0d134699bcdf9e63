"""A materialisation is a function of its inputs: the Dagster side of `stages/inputs.py`.

Before an asset computes, its input key is built from the config it reads, its parents' Dagster data versions in
this iteration, its code version and a few extras. A result recorded under the same key is reused (logged, and the
materialisation says `reused: true` and which run computed it); a retried or repaired step on the same inputs keeps
what the earlier attempt left and resumes from it; changed inputs clear the stage's working paths first, so nothing
computed from other inputs is picked up. Each materialisation's data version is its result's identity
(`stages.inputs.result_id`), which is what its children's keys hold.
"""

from __future__ import annotations

import dagster as dg

from stages.inputs import Memo, config_inputs, result_id

DATA_VERSION_TAG = "dagster/data_version"
# parents whose identity is not this iteration's materialisation: warm_start's hand-off from iteration N−1 is keyed
# by the checkpoint it hands off (path and checksum) instead
NOT_SAME_PARTITION = {"policy"}


def upstream_versions(context, iteration: str) -> dict[str, str | None]:
    """The data version of each parent's latest materialisation in this iteration (None: not materialised)."""
    out: dict[str, str | None] = {}
    for key in sorted(context.assets_def.asset_deps[context.asset_key], key=lambda k: k.to_user_string()):
        name = key.to_user_string()
        if name in NOT_SAME_PARTITION:
            continue
        res = context.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=key, asset_partitions=[iteration]), limit=1)
        mat = res.records[0].asset_materialization if res.records else None
        if mat is None:
            out[name] = None
        elif (mat.tags or {}).get(DATA_VERSION_TAG):
            out[name] = mat.tags[DATA_VERSION_TAG]
        else:  # recorded without one (e.g. reported from outside a run): the identity of its result
            out[name] = result_id(mat.metadata["result"].value) if "result" in mat.metadata else None
    return out


class AssetMemo(Memo):
    """`Memo` for the asset being materialised: `cached()` returns the reusable result (and logs the reuse) or
    prepares the directory for computing (and logs what changed); `meta()` is what the materialisation says."""

    def __init__(self, context, run_dir, asset: str, cfg, work=(), **extra):
        it = context.partition_key
        code = context.assets_def.code_versions_by_key.get(context.asset_key)
        inputs = {"asset": asset, "iteration": it, "code_version": code,
                  "config": config_inputs(asset, cfg.model_dump(mode="json")),
                  "upstream": upstream_versions(context, it), **extra}
        super().__init__(run_dir, asset, inputs, [run_dir / w for w in work])
        self.context, self.computed_by, self.changed = context, None, []

    def cached(self) -> dict | None:
        log, name = self.context.log, f"{self.asset}[{self.inputs['iteration']}]"
        hit = self.reusable()
        if hit is not None:
            result, rec = hit
            self.computed_by = rec.get("run_id") or "an earlier run"
            log.info(f"{name}: reusing the result computed by run {self.computed_by}: its inputs are unchanged "
                     f"(input key {self.key}: config {', '.join(self.inputs['config'])}; upstream "
                     f"{self.inputs['upstream'] or 'none'}; code version {self.inputs['code_version']})")
            return result
        self.changed = self.prepare(self.context.run.run_id)
        if self.changed:
            log.warning(f"{name}: recomputing from scratch, its inputs changed since the recorded result "
                        f"({'; '.join(self.changed)}); cleared {', '.join(str(p) for p in self.work) or 'its result'}")
        return None

    def save(self, result: dict, run_id: str = "") -> str:
        return super().save(result, run_id or self.context.run.run_id)

    def meta(self) -> dict:
        meta = {"reused": self.computed_by is not None, "input_key": self.key,
                "inputs": dg.MetadataValue.json(self.inputs)}
        if self.computed_by is not None:
            meta["reused_from_run"] = self.computed_by
        elif self.changed:
            meta["recomputed_because"] = dg.MetadataValue.json(self.changed)
        return meta

    def data_version(self) -> dg.DataVersion | None:
        return dg.DataVersion(self.result_id) if self.result_id else None
