"""Dagster definitions found by `dg.load_from_defs_folder` (so `dg scaffold defs …` adds files here)."""
