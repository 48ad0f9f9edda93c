"""configs/ppo_trainer.yaml, rendered from the dataclasses of verl.config.schema: every key with
its default, and its help as a comment (`python -m verl.config`)."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap
from typing import Any

from omegaconf import MISSING

from verl.config.schema import TrainerConfig

YAML_WIDTH = 120          # characters per line of the generated file
YAML_COMMENT_COLUMN = 35  # where a help that fits after its value starts; longer ones go above the key
YAML_HEADER = """\
# GENERATED from verl/config/schema.py: do not edit by hand. Change the dataclass field (its default
# or its help) there, then regenerate: python -m verl.config --write configs/ppo_trainer.yaml
# (tests/verl/config/test_config_yaml.py fails while the two differ).
#
# Trainer configuration, Hydra's primary config for python -m verl.trainer.main_ppo key=value ...:
# every key with its default, unit and meaning. Keys follow the original train_ppo.sh/train_grpo.sh
# where they mean the same thing (docs/TRAINING.md lists the ones that changed); keys of the original that
# are accepted and unused say so. "Summed over all GPUs": divided by the number of workers."""


def render_yaml(cfg: Any = None) -> str:
    """The YAML of a config tree (default: TrainerConfig's defaults), each key with its help."""
    lines = YAML_HEADER.splitlines()
    _render_fields(TrainerConfig() if cfg is None else cfg, "", lines)
    return "\n".join(lines) + "\n"


def _render_fields(node: Any, indent: str, lines: list[str]) -> None:
    for f in dataclasses.fields(node):
        value, help = getattr(node, f.name), f.metadata.get("help", "").strip()
        if not help:
            raise ValueError(f"{type(node).__name__}.{f.name} has no help: declare it with key(default, help)")
        if not indent:
            lines.append("")  # a blank line before each top-level key
        if dataclasses.is_dataclass(value):
            lines += _comment_lines(help, indent)
            lines.append(f"{indent}{f.name}:")
            _render_fields(value, indent + "  ", lines)
            continue
        line = f"{indent}{f.name}: {_yaml_value(value)}"
        trailing = f"{line.ljust(YAML_COMMENT_COLUMN - 2)}  # {help}"
        if len(trailing) <= YAML_WIDTH:
            lines.append(trailing)
        else:
            lines += _comment_lines(help, indent) + [line]


def _comment_lines(text: str, indent: str) -> list[str]:
    """`text` as comment lines above a key, in as few lines as fit and of even length (no one-word tail)."""
    def wrap(width):
        return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)

    n_lines = len(wrap(YAML_WIDTH - len(indent) - 2))
    width = -(-len(text) // n_lines)
    while len(wrap(width)) > n_lines:
        width += 1
    return [f"{indent}# {part}" for part in wrap(width)]


def _yaml_value(value: Any) -> str:
    """One value in YAML flow style, as Hydra reads it back: ??? (MISSING), null, 1.0e-06, [a, b], {k: v}."""
    import yaml

    if isinstance(value, str) and value == MISSING:
        return MISSING
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"), allow_unicode=True, sort_keys=False)
    text = text.rstrip("\n").removesuffix("\n...")  # the document end PyYAML adds after a plain scalar
    if "\n" in text:
        raise ValueError(f"{value!r} does not fit on one YAML line")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl.config",
                                     description="Render configs/ppo_trainer.yaml from the dataclasses of "
                                                 "verl/config/schema.py (to standard output by default).")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--write", metavar="PATH", help="write the YAML to PATH")
    where.add_argument("--check", metavar="PATH", help="exit with status 1 if PATH is not the generated YAML")
    args = parser.parse_args(argv)
    text = render_yaml()
    if args.write:
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(text)
    elif args.check:
        with open(args.check, encoding="utf-8") as f:
            if f.read() != text:
                print(f"{args.check} differs from verl/config/schema.py: regenerate it with "
                      f"python -m verl.config --write {args.check}", file=sys.stderr)
                return 1
    else:
        sys.stdout.write(text)
    return 0
