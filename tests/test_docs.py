"""The documentation site: `mkdocs build --strict` passes (no broken link or anchor, no page missing from the nav, no
docstring the API reference cannot render), the generated configuration reference has a row for every key of the
models, and a headless Chromium finds the quick start and the configuration reference in the built site, with the
defaults the models hold.

The site is built once per module into a temporary directory and served on 127.0.0.1 by a thread of this process.
"""

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about MkDocs 2.0 (not a build warning)
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert "WARNING" not in r.stderr, r.stderr[-6000:]
    return out


def _submodel(tp):
    """The pydantic model a field holds (directly, optional, or as a list), and whether as a list."""
    from pydantic import BaseModel

    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp, False
    args = typing.get_args(tp)
    if typing.get_origin(tp) is list and args:
        m, _ = _submodel(args[0])
        return m, m is not None
    for a in args:
        m, many = _submodel(a)
        if m is not None:
            return m, many
    return None, False


def _keys(model, prefix=""):
    out = []
    for name, f in model.model_fields.items():
        out.append(prefix + name)
        sub, many = _submodel(f.annotation)
        if sub is not None:
            out += _keys(sub, f"{prefix}{name}[]." if many else f"{prefix}{name}.")
    return out


def _field(dotted: str):
    import configs

    model, f = configs.IterationConfig, None
    for part in dotted.split("."):
        f = model.model_fields[part]
        model = _submodel(f.annotation)[0]
    return f


def _yaml_text(v) -> str:
    """A default as the reference writes it (the presets' YAML spelling)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if isinstance(v, float) else str(v)


def test_build_is_strict_and_the_reference_has_every_key(site):
    for page in ("index.html", "quickstart/index.html", "reference/configuration/index.html", "api/model/index.html",
                 "api/rollout/index.html", "api/trainers/index.html", "api/store/index.html", "benchmarks/index.html",
                 "changelog/index.html"):
        assert (site / page).is_file(), page
    import configs

    html = (site / "reference/configuration/index.html").read_text()
    rows = set(re.findall(r'<tr id="([^"]+)"', html))
    sections = {k for k, f in configs.IterationConfig.model_fields.items() if _submodel(f.annotation)[0] is not None}
    missing = [k for k in _keys(configs.IterationConfig) if k not in rows and k not in sections]
    assert not missing, f"keys without a row in the configuration reference: {missing}"
    assert all(f'id="section-{s}"' in html for s in sections), sections  # each section is a heading of its own
    api = (site / "api/rollout/index.html").read_text() + (site / "api/model/index.html").read_text()
    for obj in ("rollout.engine.Engine", "model.Transformer", "model.KVCache", "rollout.backend.ServerBackend"):
        assert f'id="{obj}"' in api, obj


@pytest.fixture(scope="module")
def served(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


KEYS = ["loop.max_crashed_share", "envs.n_eval", "sao.staleness", "opd.init", "trainer.megatron.tp"]


def test_browser_finds_the_quick_start_and_the_configuration_reference(served):
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(served + "/")
            expect(page.locator("h1").first).to_have_text(re.compile("temper"))
            nav = page.locator("nav.md-nav--primary")

            nav.get_by_role("link", name="Quick start", exact=True).first.click()
            page.wait_for_url(re.compile(r"/quickstart/$"))
            expect(page.locator("article h1")).to_have_text(re.compile("Quick start"))
            body = page.locator("article").inner_text()
            for text in ("make run", "make test", "bubblewrap", "Docker", "Chromium"):
                assert text in body, text

            nav = page.locator("nav.md-nav--primary")
            nav.get_by_role("link", name="Configuration", exact=True).first.click()
            page.wait_for_url(re.compile(r"/reference/configuration/$"))
            expect(page.locator("article h1")).to_have_text(re.compile("Configuration reference"))
            for key in KEYS:
                f = _field(key)
                row = page.locator(f'tr[id="{key}"]')
                expect(row).to_be_visible()
                cells = row.locator("td")
                expect(cells.nth(0)).to_have_text(key)
                expect(cells.nth(2)).to_have_text(_yaml_text(f.get_default(call_default_factory=True)))
                for m in f.metadata:  # the bounds the model enforces
                    for attr, sym in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
                        if getattr(m, attr, None) is not None:
                            expect(cells.nth(3)).to_contain_text(f"{sym} {getattr(m, attr)}")
            # a key's anchor is a link that lands on its row
            page.goto(served + "/reference/configuration/#loop.max_crashed_share")
            expect(page.locator('tr[id="loop.max_crashed_share"]')).to_be_in_viewport()
        finally:
            browser.close()
