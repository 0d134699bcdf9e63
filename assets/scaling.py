"""`scaling`: the curve of held-out pass@1 over iterations and cumulative post-training compute, with ScaleRL's fit and
a forecast of the next iteration checked when that iteration reports (`stages/scaling.py`)."""


import base64
import json

import dagster as dg

from .iteration import ITERATIONS, OWNERS, _code_version, _iteration_run, _upstream, evaluation
from .resources import TemperResource


def _active_params(checkpoint: str) -> int:
    """Active parameters per token of the checkpoint's model (built on the meta device: no weights read)."""
    import torch

    from model import Transformer, load_config

    cfg = load_config(checkpoint)
    with torch.device("meta"):
        return Transformer(cfg).num_parameters(active=True)


def scaling_body(context: dg.AssetExecutionContext, temper: TemperResource) -> dg.MaterializeResult:
    from stages.scaling import curve_table, scaling, scaling_png

    it = int(context.partition_key)
    student = _upstream(context, "evaluation")["student"]
    cfg = temper.config()
    res = scaling(temper.root(), it, _active_params(student), rule=cfg.hand_off)
    if len(res["points"]) < it + 1:
        raise dg.Failure(f"scaling[{it}]: iterations 1..{it} of run root {temper.root()} are not all evaluated "
                         f"(found {len(res['points']) - 1})", allow_retries=False)
    d = temper.dir(str(it))
    (d / "scaling.json").write_text(json.dumps(res, indent=1))
    table = curve_table(res)
    tr = temper.tracker()
    run = tr.stage_run(_iteration_run(temper, str(it)), str(it), "scaling")
    last = res["points"][-1]
    metrics = {"chain_pass_at_1": last["pass@1"], "cumulative_trained_tokens": float(last["tokens"]),
               "cumulative_train_flops": last["flops"],
               **{f"chain_pass_at_1_{k}": v["pass@1"] for k, v in last["domain"].items()}}
    if res["fit"]:
        f = res["fit"]
        metrics.update(fit_A=f["A"], fit_B=f["B"], fit_C_mid=f["C_mid"], forecast_next=f["forecast"]["pass@1"])
    if res["check"]:
        metrics["forecast_within_ci"] = float(res["check"]["within"])
    tr.log(run, metrics=metrics)
    png = scaling_png(res, d / "plots" / "scaling.png")
    meta: dict = {"curve": dg.MetadataValue.md(table), "points": len(res["points"]),
                  "chain_pass_at_1": last["pass@1"], "cumulative_trained_tokens": last["tokens"],
                  "result": dg.MetadataValue.json(res)}
    if png is not None:
        tr.artifact(run, png)
        meta["plot"] = dg.MetadataValue.md(
            f"![scaling](data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()})")
    if res["check"]:
        meta["forecast_within_95pct"] = res["check"]["within"]
    tr.finish(run)
    context.log.info("\n" + table)
    return dg.MaterializeResult(metadata=meta)


scaling = dg.asset(name="scaling", partitions_def=ITERATIONS, group_name="iteration", owners=OWNERS,
                   kinds={"python", "mlflow"}, deps=[evaluation], code_version=_code_version(scaling_body, "scaling"),
                   description="Held-out pass@1 of the policy each iteration hands off, against the iteration and "
                               "cumulative trained tokens and FLOPs, with ScaleRL's sigmoid fit, its forecast of the "
                               "next iteration, and the check of the last forecast")(scaling_body)
