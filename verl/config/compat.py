"""Keys of another trainer's command line, read into this one's schema: compatibility tables.

Users bring the scripts of the trainers they came from. Their keys that have a place here are read
into it; those that are accepted and unused are dropped with a log line; a value that would mean
something else here stops the run at start-up. The package whose keys they are owns the table (the
search package maps the original Search-R1's `max_turns`, `retriever.*`, `reranker.*`): the trainer
applies the tables without knowing any of their keys.

A table is found through the `verl.compat` entry point group of the installed packages
(`[project.entry-points."verl.compat"]` in their pyproject.toml; an editable install sees a new
entry point only once `pip install -e .` runs again), and through the environment variable
VERL_COMPAT, a comma-separated list of `module:attribute`, for a checkout used without installing it.

The tables are applied to the raw config, before the schema checks it (`load_config`), so that a
key a table maps is never an unknown key, and on the command line (`hydra_overrides`), so that
Hydra lets an override of such a key through (it refuses to set a key its config lacks).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from dataclasses import dataclass, field
from typing import Any

ENTRY_POINT_GROUP = "verl.compat"
ENV_VAR = "VERL_COMPAT"

log = logging.getLogger(__name__)


class CompatError(ValueError):
    """A key of a table given a value this trainer would read with another meaning."""


@dataclass(frozen=True)
class MovedKey:
    """The key's value is read as `target`'s (a dotted key of the schema)."""
    target: str
    # Whether giving the key says the run is the table's kind of run: then the table's `defaults`
    # fill what is still null (e.g. the agent loop). False for keys the default run reads too.
    selects: bool = True


@dataclass(frozen=True)
class IgnoredKey:
    """Accepted and unused: dropped, with `why` in the log."""
    why: str


@dataclass(frozen=True)
class OneValueKey:
    """Accepted with the value `accepted` only (then unused); any other stops the run with `refusal`."""
    accepted: Any
    refusal: str


@dataclass(frozen=True)
class CompatTable:
    name: str                                              # whose keys, for the log and errors
    keys: dict[str, MovedKey | IgnoredKey | OneValueKey]   # dotted key -> what it becomes
    defaults: dict[str, Any] = field(default_factory=dict)  # dotted key -> value, where still null
    # A dotted boolean key of the schema: where it is true, the run is another kind than the table's
    # (e.g. the tool-calling protocol, whose tools are configured elsewhere), so the keys that would
    # select the table's kind (MovedKey.selects) are dropped with `inactive_why` in the log, and
    # `defaults` are not filled.
    inactive_when: str | None = None
    inactive_why: str = ""

    def sections(self) -> set[str]:
        """The top-level names the table's keys live under (`retriever` of `retriever.url`)."""
        return {k.split(".", 1)[0] for k in self.keys}


def unused_on_command_line(given: set[str], is_true, tables: list[CompatTable]) -> list[str]:
    """Keys of `given` (the command line's) that a table drops because the run is another kind
    (`inactive_when`, read with `is_true(dotted)`): typed by the user for this run, so they are
    refused rather than dropped, one line each."""
    return [f"{k}: a key of {t.name}, unused with {t.inactive_when}=true ({t.inactive_why}); drop it"
            for t in tables if t.inactive_when and is_true(t.inactive_when)
            for k in sorted(given) if isinstance(t.keys.get(k), MovedKey) and t.keys[k].selects]


def compat_tables() -> list[CompatTable]:
    """The tables of the installed packages (entry points) and of VERL_COMPAT, each once."""
    specs = [ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)]
    specs += [s.strip() for s in os.environ.get(ENV_VAR, "").split(",") if s.strip()]
    return [load_table(spec) for spec in dict.fromkeys(specs)]


def load_table(spec: str) -> CompatTable:
    module, _, name = spec.partition(":")
    try:
        table = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise CompatError(f"compatibility table {spec!r} (entry point group {ENTRY_POINT_GROUP} or {ENV_VAR}) "
                          f"cannot be loaded ({e}); give it as 'package.module:TABLE'") from None
    if not isinstance(table, CompatTable):
        raise CompatError(f"compatibility table {spec!r} is a {type(table).__name__}, not a CompatTable")
    return table


def hydra_overrides(argv: list[str], known: set[str], tables: list[CompatTable]) -> list[str]:
    """`key=value` for a table's key that the primary config lacks (`known`: its dotted keys) becomes
    `++key=value` (add or set), as Hydra refuses to set a key its config does not hold."""
    mapped = {k for t in tables for k in t.keys}
    out = []
    for arg in argv:
        dotted = arg.split("=", 1)[0]
        if "=" in arg and not arg.startswith(("+", "~")) and dotted in mapped and dotted not in known:
            arg = "++" + arg
        out.append(arg)
    return out


def apply_tables(config: dict, tables: list[CompatTable], schema: dict) -> list[str]:
    """Read the tables' keys in `config` (a plain nested dict, changed in place) into the schema's
    keys. `schema`: the schema's defaults as a nested dict (a target still at its default is free to
    take a table's value; a table's section that is one of the schema's keeps its other keys).
    Returns what was done, one line each, for the log."""
    schema_sections = set(schema)
    notes = []
    for table in tables:
        given = [k for k in table.keys if _has(config, k)]
        inactive = bool(table.inactive_when and _get(config, table.inactive_when))
        for dotted in given:
            what, value = table.keys[dotted], _pop(config, dotted)
            if inactive and isinstance(what, MovedKey) and what.selects:
                notes.append(f"{dotted}={value}: a key of {table.name}, unused with {table.inactive_when}=true "
                             f"({table.inactive_why})")
            elif isinstance(what, MovedKey):
                _move(config, dotted, value, what.target, _get(schema, what.target))
            elif isinstance(what, OneValueKey):
                if value != what.accepted:
                    raise CompatError(f"{dotted}={value}: {what.refusal}")
            else:
                notes.append(f"{dotted}={value}: a key of {table.name}, accepted and unused ({what.why})")
        for section in table.sections() - schema_sections:
            left = config.get(section)
            if left == {} or left is None and section in config:
                del config[section]
            elif left is not None:
                known = sorted(k for k in table.keys if k.split(".", 1)[0] == section)
                raise CompatError(f"{section}.{next(iter(left))}: not a key of {table.name} that is read here "
                                  f"(those under {section}: {', '.join(known)})" if isinstance(left, dict) else
                                  f"{section}: give its keys ({', '.join(known)})")
        selecting = [k for k in given if isinstance(table.keys[k], MovedKey) and table.keys[k].selects
                     and not inactive]
        filled = [f"{k}={v}" for k, v in table.defaults.items() if selecting and _get(config, k) is None]
        for k, v in table.defaults.items():
            if selecting and _get(config, k) is None:
                _set(config, k, v)
        if filled:
            notes.append(f"{', '.join(selecting)} given: keys of {table.name}, which ran with {' and '.join(filled)}; "
                         "set so here (name others to change them)")
    return notes


def _move(config: dict, dotted: str, value: Any, target: str, default: Any) -> None:
    current = _get(config, target)
    if current is not None and current != default and current != value:
        raise CompatError(f"{dotted}={value} and {target}={current} set the same thing: give one")
    _set(config, target, value)


_MISSING = object()


def _lookup(config: dict, dotted: str) -> Any:
    """The value at `dotted`, or _MISSING where a part of the path is absent."""
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _has(config: dict, dotted: str) -> bool:
    return _lookup(config, dotted) is not _MISSING


def _get(config: dict, dotted: str) -> Any:
    value = _lookup(config, dotted)
    return None if value is _MISSING else value


def _pop(config: dict, dotted: str) -> Any:
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        node = node[part]
    return node.pop(last)


def _set(config: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        if node.get(part) is None:   # a null section (e.g. agent_kwargs: null) becomes a dict
            node[part] = {}
        node = node[part]
    node[last] = value
