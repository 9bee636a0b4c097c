"""The guides installed with zckpt (``zckpt help``) are for users: no commit ids, no history of the source tree,
no repository paths, no make targets; the one CRC dependency named as it is; shell completion documented as it works;
the deprecated import paths gone."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib

from tests.conftest import ROOT

#: a commit id: 7-40 hex digits holding a letter and a digit (sizes and counts are digits only)
COMMIT = re.compile(r"(?<![\w/.#-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])")
HISTORY = re.compile(r"the tree before|used to be|make demo|make test|was printed twice|printed twice before", re.I)
#: a path inside the repository (a module, a test, a benchmark script)
REPO_PATH = re.compile(r"(?<![\w./:@-])(tests|zckpt|benchmarks)/[\w./-]*\w")
#: guides whose notes on how a claim is tested still name the test files (reference guides, to be rewritten)
TESTED_NOTES = {"megatron.md"}


def installed_guides() -> list[str]:
    """The guides the wheel installs (pyproject's data-files): what ``zckpt help`` shows."""
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = doc["tool"]["setuptools"]["data-files"]["share/doc/zckpt"]
    names = sorted({p.name for g in globs for p in ROOT.glob(g)})
    assert "guide.md" in names and "architecture.md" not in names and "benchmarks.md" not in names
    return names


def test_installed_guides_are_for_users():
    bad = []
    for name in installed_guides():
        for number, line in enumerate((ROOT / "docs" / name).read_text().splitlines(), 1):
            found = [m.group(0) for m in COMMIT.finditer(line)] + [m.group(0) for m in HISTORY.finditer(line)]
            if name not in TESTED_NOTES:
                found += [m.group(0) for m in REPO_PATH.finditer(line)]
            bad += [f"docs/{name}:{number}: {f}" for f in found]
    assert not bad, "\n".join(bad)


def test_installed_guides_link_only_installed_guides():
    names = set(installed_guides())
    links = [(n, m.group(1)) for n in names
             for m in re.finditer(r"\]\(([\w-]+\.md)(?:#[^)]*)?\)", (ROOT / "docs" / n).read_text())]
    assert links and not [x for x in links if x[1] not in names], [x for x in links if x[1] not in names]


def test_crc_dependency_named_as_it_is():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("isal") for d in deps) and not any(d.startswith("zlib-ng") for d in deps)
    guide = (ROOT / "docs" / "guide.md").read_text()
    assert "The CRC is ISA-L's (`isal`, a dependency" in guide and "pip install zlib-ng" not in guide


def test_shell_completion_as_documented():
    guide = (ROOT / "docs" / "guide.md").read_text()
    assert 'eval "$(_ZCKPT_COMPLETE=bash_source zckpt)"' in guide
    env = {**os.environ, "_ZCKPT_COMPLETE": "bash_source"}
    script = subprocess.run([sys.executable, "-m", "zckpt"], env=env, capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert script.returncode == 0 and "_ZCKPT_COMPLETE=bash_complete" in script.stdout, script.stderr
    env = {**os.environ, "_ZCKPT_COMPLETE": "bash_complete", "COMP_WORDS": "zckpt merge --dt", "COMP_CWORD": "2"}
    got = subprocess.run([sys.executable, "-m", "zckpt"], env=env, capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert "plain,--dtype" in got.stdout.splitlines(), got.stdout


def test_deprecated_aliases_are_gone():
    for name in ("zckpt.ops.push", "zckpt.ops.scan"):
        assert importlib.util.find_spec(name) is None, name


def test_readme_says_what_megatron_merge_needs_for_config_json():
    readme = (ROOT / "README.md").read_text()
    assert "zckpt merge megatron-ckpt/ -o llama/" in readme
    assert "`norm_epsilon`, `rotary_base` and `rotary_percent` 1.0" in readme
