"""The package's shape: imports flow one way (no cycles, even inside functions) and no module reaches into
another's private names. A change that knots modules together fails here (docs/architecture.md)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "zckpt"


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    return mods


def _imports(name: str, path: Path, mods: dict) -> list[tuple[str, str | None]]:
    """(imported module, imported name or None) for every zckpt import anywhere in the file."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            if base.split(".")[0] != "zckpt":
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.append((full, None) if full in mods else (base, alias.name))
        elif isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.split(".")[0] == "zckpt"]
    return out


@functools.lru_cache(maxsize=1)  # the same tree for every test of this file: read and parsed once
def _graph():
    mods = _modules()
    edges = {m: set() for m in mods}
    private = []
    for m, p in mods.items():
        for target, name in _imports(m, p, mods):
            if target in mods and target != m and not (m.startswith(target + ".") and target == "zckpt"):
                edges[m].add(target)
            if name and name.startswith("_") and not name.startswith("__"):
                private.append(f"{m} imports {target}.{name}")
    return mods, edges, private


def test_no_import_cycles():
    mods, edges, _ = _graph()
    edges = {m: set(ts) for m, ts in edges.items()}  # (the cached graph stays as read)
    # package __init__ files re-export lazily (PEP 562); an edge into a package's own __init__ is not a cycle
    for m in edges:
        edges[m] = {t for t in edges[m] if not (mods[t].name == "__init__.py" and m.startswith(t + "."))}
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    assert not sccs, f"import cycles: {sccs}"


def test_no_cross_module_private_imports():
    _, _, private = _graph()
    assert not private, "private names imported across modules:\n" + "\n".join(private)


def test_no_module_and_function_share_a_name():
    """``zckpt.ops.merge`` must be one thing: a module attribute of the package never shadows a submodule."""
    import zckpt
    mods = _modules()
    clashes = [n for n in getattr(zckpt, "__all__", []) if f"zckpt.{n}" in mods]
    assert not clashes, clashes


# docs/architecture.md: each module's layer; imports may only go to the same or a lower layer
LAYERS = [
    ("vocabulary", ["zckpt.errors", "zckpt.units", "zckpt.lazy"]),
    ("io", ["zckpt.io"]),
    ("encoding", ["zckpt.encoding"]),
    ("engine", ["zckpt.engine"]),
    ("state", ["zckpt.state"]),
    ("formats", ["zckpt.deepspeed", "zckpt.dcp", "zckpt.megatron", "zckpt.hf"]),
    ("backup", ["zckpt.backup"]),
    ("ops", ["zckpt.ops"]),
    ("front ends", ["zckpt.cli", "zckpt.integrations", "zckpt.__main__", "zckpt.api"]),
]


def _layer(module: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return len(LAYERS)  # the package's __init__ (the lazy public API) sits on top


def test_imports_follow_the_layers():
    mods, edges, _ = _graph()
    assert all(_layer(m) < len(LAYERS) for m in mods if m != "zckpt"), [m for m in mods if _layer(m) == len(LAYERS)]
    wrong = [f"{m} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0] if _layer(t) < len(LAYERS) else 'api'})"
             for m, ts in edges.items() for t in ts if t != "zckpt" and _layer(t) > _layer(m)]
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


# the format packages: each reads (and writes) one format; none imports another, so a format is added or removed as
# one package (docs/architecture.md). The one opener (zckpt.state.open) asks each format's reader by module name.
FORMAT_PACKAGES = ["zckpt.deepspeed", "zckpt.dcp", "zckpt.megatron", "zckpt.hf"]


def _package(module: str) -> str | None:
    return next((p for p in FORMAT_PACKAGES if module == p or module.startswith(p + ".")), None)


def test_formats_are_peers():
    """No format package imports another; each declares what it reads and writes in one registry entry."""
    _, edges, _ = _graph()
    crossing = sorted(f"{m} imports {t}" for m, ts in edges.items() for t in ts
                      if _package(m) and _package(t) and _package(m) != _package(t))
    assert not crossing, "format packages importing each other:\n" + "\n".join(crossing)


def test_formats_declare_through_the_registry():
    """Every format package has a ``format`` module whose ``FORMAT`` (a :class:`zckpt.state.formats.Format`) is one
    line of the registry; its abilities are methods, never module names looked up elsewhere (no ``CRC_ENTRIES``
    strings, no importlib outside the registry and the lazy package attributes)."""
    import importlib
    from zckpt.state import formats
    mods = _modules()
    assert sorted(formats.REGISTRY) == sorted(f"{p}.format" for p in FORMAT_PACKAGES), formats.REGISTRY
    names = []
    for module in formats.REGISTRY:
        fmt = importlib.import_module(module).FORMAT
        assert isinstance(fmt, formats.Format) and fmt.name, module
        assert fmt.claims is None or callable(fmt.read), module
        names.append(fmt.name)
        assert formats.named(fmt.name) is fmt
    assert len(set(names)) == len(names), names
    assert formats.names()[:1] == ["megatron"]  # claimed before DCP: torch_dist has a .metadata too
    allowed = {"zckpt.state.formats", "zckpt.lazy", "zckpt.errors", "zckpt.cli", "zckpt.cli.estimate",
               "zckpt.cli._common", "zckpt.backup.hub",
               "zckpt.encoding.casting"}  # (the last five: optional third-party packages, not formats)
    looked_up = sorted(m for m, p in mods.items() if m not in allowed and "importlib" in p.read_text())
    assert not looked_up, f"modules looking modules up by name outside the registry: {looked_up}"
    legacy = sorted(m for m, p in mods.items() if any(f"\n{k} = " in p.read_text()
                                                     for k in ("CRC_ENTRIES", "MERGE_VIEW", "STATE_VIEW")))
    assert not legacy, legacy


# operations go down only: none imports another, except the helpers named here (and convert's target halves)
OPS_HELPERS = {"zckpt.ops.outputs", "zckpt.ops.verify_checks", "zckpt.ops.verify_report", "zckpt.ops.resume_checks",
               "zckpt.ops.model_size"}
OPS_PARTS = {"zckpt.ops.convert": {"zckpt.ops.to_deepspeed"},  # convert --to deepspeed: the DCP-source route
             "zckpt.ops.diff": {"zckpt.ops.diff_values"}}  # diff: the plain values it compares


def test_operations_call_no_other_operation():
    mods, edges, _ = _graph()
    wrong = sorted(f"{m} imports {t}" for m, ts in edges.items() for t in ts
                   if m.startswith("zckpt.ops.") and t.startswith("zckpt.ops.") and t not in OPS_HELPERS
                   and t not in OPS_PARTS.get(m, ()))
    assert not wrong, "operations importing another operation:\n" + "\n".join(wrong)
    assert all(h in mods for h in OPS_HELPERS)


def test_formats_and_below_do_not_ask_backup():
    """Which files belong to a checkpoint is known below the formats (zckpt.state.files); writing operations
    (merge, reshard, convert) ask their source's format, not the backup layer above it."""
    _, edges, _ = _graph()
    wrong = sorted(f"{m} imports {t}" for m in ("zckpt.ops.merge", "zckpt.ops.reshard", "zckpt.ops.convert",
                                                "zckpt.ops.to_deepspeed")
                   for t in edges.get(m, ()) if t.startswith("zckpt.backup"))
    assert not wrong, wrong


def test_modules_stay_small():
    """One concept per module: none over 600 lines (docs/architecture.md lists what each holds)."""
    big = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > 600}
    assert not big, f"modules over 600 lines: {big}"


def test_operations_are_thin():
    """merge, reshard and convert pair a reader and a writer: the operation modules stay under 300 lines."""
    thick = {m: n for m in ("zckpt.ops.merge", "zckpt.ops.reshard", "zckpt.ops.convert", "zckpt.ops.to_deepspeed")
             if (n := len(_modules()[m].read_text().splitlines())) > 300}
    assert not thick, thick


def test_a_command_imports_only_the_reader_it_needs():
    """Start-up cost: opening a ZeRO-2 checkpoint imports the ZeRO-1/2 reader, none of the others."""
    import subprocess
    import sys
    code = ("import sys; from zckpt.state.open import open_checkpoint; "
            f"open_checkpoint({str(PKG.parent / 'fixtures' / 'z2_bf16_ws2')!r}); "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('zckpt.deepspeed.'))))")
    loaded = set(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                                cwd=PKG.parent).stdout.split())
    readers = {"zero0", "zero12", "zero3", "pipeline", "moe", "autoep", "expert_groups", "tp", "universal_read"}
    assert {m.rsplit(".", 1)[1] for m in loaded} & readers == {"zero12"}, loaded
