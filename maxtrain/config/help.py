"""--help and --help-keys for the entry points that take a config (train, generate, compile).

base.yml is where every key is documented: its default and a comment. The comments are read here, once,
from the file itself, so `--help-keys` shows what the file says and nothing can drift from it; each key's type
is its default's (maxtrain.config.load checks every value against it).
"""

from __future__ import annotations

import difflib
import fnmatch
import re
import sys

import yaml

from maxtrain.config import load as config_lib

from maxtrain.config import keys as config_keys

HELP_FLAGS = ("-h", "--help")
KEYS_FLAG = "--help-keys"
_KEY_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*):(.*)$")
_COMMENT_LINE = re.compile(r"^(\s*)#\s?(.*)$")
_SECTION = re.compile(r"^#\s*-{3,}")  # "# ---- run ----": a heading, not a key's comment


def where_keys_are() -> str:
    return (f"Every key, with its default and meaning, is in {config_lib.BASE_YML};\n"
            f"python -m maxtrain.train {KEYS_FLAG} [PATTERN] prints the keys whose name contains PATTERN\n"
            "(or matches a glob like 'eval_*').")


def key_docs() -> dict[str, tuple[str, str]]:
    """key -> (default as base.yml writes it, comment): the comment beside the key with the indented comment
    lines under it, or, for a key with none beside it, the comment block just above it."""
    values = config_lib.defaults()
    docs: dict[str, tuple[str, str]] = {}
    block: list[str] = []  # the comment lines since the last key or blank line
    key = None  # the key whose indented comment lines may follow
    for line in config_lib.BASE_YML.read_text(encoding="utf-8").splitlines():
        comment = _COMMENT_LINE.match(line)
        if comment and comment.group(1) and key is not None:  # an indented comment: the key above goes on
            default, text = docs[key]
            docs[key] = (default, f"{text} {comment.group(2)}".strip())
            continue
        key = None
        if comment:
            block = [] if _SECTION.match(line) else [*block, comment.group(2)]
            continue
        found = _KEY_LINE.match(line)
        if not found:
            block = [] if not line.strip() else block
            continue
        key, rest = found.group(1), found.group(2)
        value, _, text = rest.partition(" #")
        value, text = value.strip(), text.strip().lstrip("#").strip()
        if not value or value in ("[", "{"):  # a value over several lines: shown as YAML in one line
            value = yaml.safe_dump(values[key], default_flow_style=True, width=10**6).strip()
        docs[key] = (value, text or " ".join(block))
        block = []
    return docs


def matching_keys(pattern: str | None) -> list[str]:
    """Lines `key: type = default  # comment` for the keys whose name contains `pattern` (or matches it as a
    glob)."""
    docs = key_docs()
    if pattern is None:
        names = list(docs)
    elif any(ch in pattern for ch in "*?["):
        names = [k for k in docs if fnmatch.fnmatchcase(k, pattern)]
    else:
        names = [k for k in docs if pattern.lower() in k.lower()]
    if not names:
        close = difflib.get_close_matches(pattern, list(docs), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else f"; {KEYS_FLAG} with no pattern lists all {len(docs)}"
        raise config_keys.ConfigError(KEYS_FLAG, f"no key matches {pattern!r}{hint}")
    values = config_lib.defaults()
    heads = {k: f"{k}: {type(values[k]).__name__} = {docs[k][0]}" for k in names}
    width = max(len(h) for h in heads.values())
    return [heads[k].ljust(width) + (f"  # {docs[k][1]}" if docs[k][1] else "") for k in names]


PRESETS_FLAG = "--list-presets"


def _count(n: int) -> str:
    """1.71B, 494M: three digits, in billions from 999.5M on (which .3g would print as 1e+03M)."""
    return f"{n / 1e9:.3g}B" if n >= 0.9995e9 else f"{n / 1e6:.3g}M"


def preset_lines() -> list[str]:
    """`name  family  parameters  (layers x width, experts)` for every preset model_name takes."""
    from maxtrain.models import registry
    rows = []
    for path in sorted((config_lib.CONFIG_DIR / "models").glob("*.yml"), key=lambda p: p.stem):
        c = config_lib.load([str(config_lib.BASE_YML), f"model_name={path.stem}"])
        experts = f", {c.num_experts} experts ({c.num_experts_per_tok} active)" if c.num_experts > 1 else ""
        active = f" ({_count(c.num_active_params)} active)" if c.num_active_params != c.num_params else ""
        rows.append((path.stem, registry.spec_for(c).name, f"{_count(c.num_params)}{active}",
                     f"{c.base_num_decoder_layers} layers x {c.base_emb_dim}{experts}, vocab {c.vocab_size}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {n:<{widths[2]}}  {d}" for a, b, n, d in rows] + [
        "", "model_name=NAME picks one (its model keys over the config file's; key=value over both)."]


def handle(argv: list[str], usage: str) -> int | None:
    """The exit code when argv asks for help (or is empty), else None: the entry point goes on. -h/--help
    anywhere prints the usage; --help-keys [PATTERN] prints the matching keys."""
    if PRESETS_FLAG in argv:
        print("\n".join(preset_lines()), flush=True)
        return 0
    if KEYS_FLAG in argv:
        rest = argv[argv.index(KEYS_FLAG) + 1:]
        try:
            lines = matching_keys(rest[0] if rest else None)
        except config_keys.ConfigError as e:
            print(f"{e.kind} error: {e}", file=sys.stderr, flush=True)
            return 2
        print("\n".join(lines), flush=True)
        return 0
    if not argv or any(a in HELP_FLAGS for a in argv):
        print(f"{usage}\n\n{where_keys_are()}", file=sys.stdout if argv else sys.stderr, flush=True)
        return 0 if argv else 2
    return None
