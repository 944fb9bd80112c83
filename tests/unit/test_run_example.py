"""docs/run.example.toml, which docs/OPERATOR.md says lists every key with its default: it loads, and names every
key of every section (as a key, or as a commented ``# key =`` line where the default cannot be written in TOML)."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from swarm.config import RunConfig
from swarm.config.run import load_run_config

pytestmark = pytest.mark.timeout(60)

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "run.example.toml"


def test_the_example_config_loads():
    load_run_config(EXAMPLE).validate()


def test_the_example_config_names_every_key():
    text = EXAMPLE.read_text()
    written = tomllib.loads(text)
    # a key whose default TOML cannot write is a comment: "# key = value" or "# [section.key]"
    commented = set(re.findall(r"^# ?([a-z_]+) *=", text, flags=re.M)) | set(
        re.findall(r"^# ?\[([a-z_.]+)\]", text, flags=re.M)
    )
    missing = []
    for section in dataclasses.fields(RunConfig):
        value = getattr(RunConfig(), section.name)
        if not dataclasses.is_dataclass(value):
            if section.name not in written:
                missing.append(section.name)
            continue
        for key in dataclasses.fields(value):
            if (
                key.name not in written.get(section.name, {})
                and key.name not in commented
                and f"{section.name}.{key.name}" not in commented
            ):
                missing.append(f"[{section.name}] {key.name}")
    assert not missing, f"docs/run.example.toml does not name {missing}; add each with its default and a comment."
