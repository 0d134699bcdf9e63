"""MkDocs hook: the configuration reference, generated from the pydantic models at every build.

`configs.IterationConfig` composes each room's config model (`ModelConfig`, `EnvConfig`, `AgentConfig`, `SAOConfig`,
`OPDConfig`, `LoopConfig`, `BaseConfig`, `TrainerConfig`, ...). This hook walks it and writes one row per key path:
its type, its default, its constraints (ge / gt / le / lt, lengths, the choices of a `Literal`), its description, and
the values the presets in `configs/presets/` set. The Dagster resources of `assets/resources.py` follow, the same way.

A key's description is, in order: its `description=`; else what its source says (the comment block right above the
field, its trailing comment, a docstring right after it); else its entry in `config_notes.yaml` beside this file. A
one-line comment of a few words and no punctuation (`# MoE`) heads a group of fields and describes none. An entry in
`config_notes.yaml` for a key the models no longer have fails the build, so nothing here can describe a key that is
gone, and every type, default and bound is read from the models themselves.

    python docs/_hooks/config_reference.py > /tmp/configuration.md      # the page's Markdown, without MkDocs
"""

from __future__ import annotations

import ast
import enum
import functools
import html
import inspect
import io
import re
import sys
import tokenize
import types
import typing
import warnings
from pathlib import Path
from typing import Any

PAGE = "reference/configuration.md"
ROOT = Path(__file__).resolve().parents[2]
NOTES = Path(__file__).with_name("config_notes.yaml")
RESOURCES = ("temper", "rollout", "sandbox", "pipes", "trainer")  # `assets.resources` classes, by resource key


class StaleNote(ValueError):
    pass


# ---- the MkDocs hook --------------------------------------------------------------------------------------------
def on_files(files, config):
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files


# ---- descriptions from the source -------------------------------------------------------------------------------
_HEADING = re.compile(r"^[A-Za-z0-9][\w -]{0,40}$")


def _is_heading(block: list[str]) -> bool:
    """A comment that names a group of fields (`# MoE`, `# DSA lightning indexer`), not one field."""
    return len(block) == 1 and len(block[0].split()) <= 4 and bool(_HEADING.match(block[0]))


@functools.cache
def _source_notes(cls: type) -> dict[str, tuple[str, str]]:
    """{field: (group heading above it, description)} from the comments and docstrings of `cls`'s class body."""
    try:
        path = inspect.getsourcefile(cls)
        text = Path(path).read_text() if path else ""
        first = inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        return {}
    lines = text.splitlines()
    comments: dict[int, str] = {}  # line -> comment text
    own_line: set[int] = set()  # lines that hold only a comment
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0]
            comments[row] = tok.string.lstrip("#").strip()
            if not lines[row - 1][: tok.start[1]].strip():
                own_line.add(row)
    node = next((n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef) and n.name == cls.__name__
                 and first <= n.lineno <= first + len(n.decorator_list)), None)
    if node is None:
        return {}
    out: dict[str, tuple[str, str]] = {}
    for i, st in enumerate(node.body):
        if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)):
            continue
        block: list[str] = []
        row = st.lineno - 1
        while row in own_line:
            block.insert(0, comments[row])
            row -= 1
        block = [b for b in block if b.strip("-= ")]  # separators (# ------)
        heading = ""
        if _is_heading(block):
            heading, block = block[0], []
        desc = " ".join(block)
        trailing = [comments[r] for r in range(st.lineno, (st.end_lineno or st.lineno) + 1)
                    if r in comments and r not in own_line]
        desc = " ".join([desc, *trailing]).strip()
        nxt = node.body[i + 1] if i + 1 < len(node.body) else None
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            desc = f"{desc} {inspect.cleandoc(nxt.value.value)}".strip()
        out[st.target.id] = (heading, re.sub(r"^\.\.\.\s*", "", desc))
    return out


def own_doc(cls: type) -> str:
    """`cls`'s own docstring (not one inherited from pydantic's BaseModel or Dagster's resource class)."""
    doc = vars(cls).get("__doc__")
    return inspect.cleandoc(doc) if doc else ""


# ---- types, defaults and constraints ----------------------------------------------------------------------------
def _model_in(tp: Any) -> tuple[type | None, bool]:
    """(the pydantic model a field holds, whether as a list of them), or (None, False)."""
    from pydantic import BaseModel

    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp, False
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        for a in args:
            m, many = _model_in(a)
            if m is not None:
                return m, many
    if origin is list and args:
        m, _ = _model_in(args[0])
        return m, m is not None
    return None, False


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "None"
    if origin is typing.Literal:
        return " | ".join(dict.fromkeys(type(a).__name__ for a in args))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(a) for a in args)}]" if args else name
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "str"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _choices(tp: Any) -> list[Any]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return list(args)
    if origin in (typing.Union, types.UnionType):
        return [c for a in args for c in _choices(a)]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return [m.value for m in tp]
    return []


def value_text(v: Any) -> str:
    """A value as the presets' YAML spells it."""
    from pydantic import BaseModel

    if isinstance(v, enum.Enum):
        v = v.value
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return v if v else '""'
    if isinstance(v, BaseModel):
        return value_text(v.model_dump(mode="json"))
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(value_text(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {value_text(x)}" for k, x in v.items()) + "}"
    return str(v)


def constraints(field: Any) -> list[str]:
    import annotated_types as at

    out = []
    for m in field.metadata:
        if isinstance(m, (at.Gt, at.Ge, at.Lt, at.Le, at.Interval)):
            for attr, sym in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
                if getattr(m, attr, None) is not None:
                    out.append(f"{sym} {value_text(getattr(m, attr))}")
        elif isinstance(m, at.MinLen):
            out.append(f"at least {m.min_length} item{'s' if m.min_length != 1 else ''}")
        elif isinstance(m, at.MaxLen):
            out.append(f"at most {m.max_length} items")
    choices = _choices(field.annotation)
    if choices:
        out.append("one of " + ", ".join(f"`{value_text(c)}`" for c in choices))
    return out


# ---- rows -------------------------------------------------------------------------------------------------------
class Row(typing.NamedTuple):
    key: str
    type: str
    default: str
    constraints: list[str]
    description: str
    heading: str


def rows(model: type, prefix: str = "", skip: frozenset[str] = frozenset()) -> list[Row]:
    """Every key path under `model`, depth first: a nested model's keys follow its own row. `skip`: fields whose
    nested model is not expanded."""
    notes: dict[str, tuple[str, str]] = {}
    for klass in reversed(model.__mro__):  # a subclass's comment wins over its base's
        if not klass.__module__.startswith(("pydantic", "dagster", "builtins", "typing", "abc")):
            notes.update(_source_notes(klass))
    out: list[Row] = []
    for name, f in model.model_fields.items():
        key = prefix + name
        heading, desc = notes.get(name, ("", ""))
        sub, many = _model_in(f.annotation)
        if name in skip:
            sub, default = None, "(see the keys above)"
        elif f.is_required():
            default = "required"
        elif sub is not None and not many and f.get_default(call_default_factory=True) is not None:
            default = "(the keys below)"
        else:
            default = value_text(f.get_default(call_default_factory=True))
        out.append(Row(key, type_name(f.annotation), default, constraints(f), f.description or desc, heading))
        if sub is not None:
            out += rows(sub, f"{key}[]." if many else f"{key}.")
    return out


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of a preset's YAML (lists are values)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def preset_values() -> dict[str, dict[str, Any]]:
    """{preset: {key path it sets: value}}."""
    import yaml

    import configs

    return {name: _flatten(yaml.safe_load((configs.PRESET_DIR / f"{name}.yaml").read_text()) or {})
            for name in configs.preset_names()}


def _notes() -> tuple[dict[str, str], dict[str, str]]:
    import yaml

    data = yaml.safe_load(NOTES.read_text()) or {}
    return data.get("sections") or {}, data.get("keys") or {}


def _describe(rs: list[Row], notes: dict[str, str], used: set[str], id_prefix: str = "") -> list[Row]:
    out = []
    for r in rs:
        key = id_prefix + r.key
        if key in notes:
            used.add(key)
        out.append(r if r.description or key not in notes else r._replace(description=" ".join(notes[key].split())))
    return out


# ---- HTML -------------------------------------------------------------------------------------------------------
def _inline(text: str) -> str:
    """Escaped text with its `code` spans."""
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: no code spans
        return html.escape(text)
    return "".join(f"<code>{html.escape(p)}</code>" if i % 2 else html.escape(p) for i, p in enumerate(parts))


def _breakable(key: str) -> str:
    """A key path that may wrap after its dots."""
    return ".<wbr>".join(html.escape(p) for p in key.split("."))


def _cut(s: str, n: int = 90) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def table(rs: list[Row], presets: dict[str, dict[str, Any]] | None = None, id_prefix: str = "") -> str:
    head = "".join(f"<th>{h}</th>" for h in ("key", "type", "default", "constraints", "description"))
    body = []
    for r in rs:
        if r.heading:
            body.append(f'<tr class="temper-group"><td colspan="5"><em>{html.escape(r.heading)}</em></td></tr>')
        desc = _inline(r.description)
        set_by = [(p, vals[r.key]) for p, vals in (presets or {}).items() if r.key in vals]
        if set_by:
            desc += ("<br><small>presets: " + " · ".join(
                f"{html.escape(p)} <code>{html.escape(_cut(value_text(v)))}</code>" for p, v in set_by) + "</small>")
        if r.default in ("required",) or r.default.startswith("("):
            default = f"<em>{html.escape(r.default)}</em>"
        else:
            default = f"<code>{html.escape(_cut(r.default))}</code>"
        anchor = html.escape(id_prefix + r.key)
        body.append(
            f'<tr id="{anchor}"><td><a href="#{anchor}"><code>{_breakable(r.key)}</code></a></td>'
            f"<td><code>{html.escape(r.type)}</code></td><td>{default}</td>"
            f"<td>{', '.join(_inline(c) for c in r.constraints)}</td><td>{desc}</td></tr>")
    return ('<div class="temper-config">\n<table>\n<thead><tr>' + head + "</tr></thead>\n<tbody>\n" + "\n".join(body)
            + "\n</tbody>\n</table>\n</div>\n")


_INTRO = """\
---
hide:
  - toc
---

# Configuration reference

<!-- generated by docs/_hooks/config_reference.py from the pydantic models at build time: do not edit -->

One `IterationConfig` configures an iteration. It composes one pydantic model per room and loads from a preset in
`configs/presets/` (`tiny` is the CPU default) with `key.path=value` overrides:

```bash
.venv/bin/temper config show --preset tiny -o loop.steps=40 -o envs.n_rl=480   # the resolved config, as JSON
.venv/bin/temper run --preset micro -o trainer.kind=megatron                    # any command that takes a preset
```

```python
import configs
cfg = configs.load("tiny", ["loop.max_crashed_share=0.1"])
```

Unknown keys and bad values fail before anything runs, naming the key path (with a "did you mean" for a misspelt
key). This page is generated from the models at every build of the site: every key, type, default and bound below is
read from the code. **default** is the model's default. A preset may set another value; each preset that sets a key
is listed under it. *required* keys have no default and come from the preset. `[]` in a key path marks a list of such
entries (`base.curriculum[].from_step`).

"""


def render() -> str:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import configs

    section_notes, key_notes = _notes()
    used: set[str] = set()
    presets = preset_values()
    fields = configs.IterationConfig.model_fields
    sections = [k for k, f in fields.items() if _model_in(f.annotation)[0] is not None]
    parts = [_INTRO, "## Sections\n\n", "| section | model | what it holds |\n|---|---|---|\n"]
    for k in sections:
        sub = _model_in(fields[k].annotation)[0]
        what = section_notes.get(k) or own_doc(sub).split("\n\n")[0]
        parts.append(f"| [`{k}`](#section-{k}) | `{sub.__name__}` | {' '.join(what.split()).replace('|', '&#124;')} |\n")
    parts.append("| [resources](#resources) | Dagster resources | Where a run's engines, sandbox and stages run. |\n")
    parts.append("\nTop-level keys:\n\n")
    top = [r for r in rows(configs.IterationConfig) if "." not in r.key and r.key not in sections]
    parts.append(table(_describe(top, key_notes, used), presets))
    for k in sections:
        sub = _model_in(fields[k].annotation)[0]
        parts.append(f"\n## `{k}` {{ #section-{k} }}\n\n")
        if doc := own_doc(sub):
            parts.append(doc + "\n\n")
        elif k in section_notes:
            parts.append(" ".join(section_notes[k].split()) + "\n\n")
        parts.append(f"Model: `{sub.__module__}.{sub.__name__}`.\n\n")
        parts.append(table(_describe(rows(sub, f"{k}."), key_notes, used), presets))
    parts.append(_resources(key_notes, used))
    stale = sorted(set(key_notes) - used) + sorted(set(section_notes) - set(sections))
    if stale:
        raise StaleNote(f"{NOTES.name}: no such configuration key(s): {', '.join(stale)} (remove or rename the entries)")
    return "".join(parts)


def _resources(key_notes: dict[str, str], used: set[str]) -> str:
    """The Dagster resources' fields: how a run is deployed (engines, sandbox, where stages run)."""
    with warnings.catch_warnings():  # dagster's preview warnings at import
        warnings.simplefilter("ignore")
        import assets

    parts = ["\n## Dagster resources { #resources }\n\n",
             "Set in the Dagster Launchpad (or a run config under `resources:`), not in a preset: where the engines, "
             "the sandbox and the stages run. `temper run --servers N` sets `rollout` for you. See "
             "[the pipeline](../pipeline.md). Their keys are `resources.<name>.<field>` in the anchors of this page.\n\n"]
    defs = {"temper": assets.TemperResource, "rollout": assets.RolloutBackend, "sandbox": assets.SandboxResource,
            "pipes": assets.StageRunner, "trainer": assets.TrainerBackend}
    for name in RESOURCES:
        cls = defs[name]
        parts.append(f"### `{name}` {{ #resource-{name} }}\n\n")
        if doc := own_doc(cls):
            parts.append(doc + "\n\n")
        parts.append(f"Class: `{cls.__module__}.{cls.__name__}`.\n\n")
        rs = _describe(rows(cls, f"{name}.", skip=frozenset({"settings"})), key_notes, used, "resources.")
        parts.append(table(rs, id_prefix="resources."))
    return "".join(parts)


if __name__ == "__main__":
    sys.stdout.write(render())
