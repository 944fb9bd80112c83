"""Run configuration: small frozen dataclasses, one per component, loaded from TOML.

A run's spec travels from the coordinator to every peer as JSON (``RunConfig.to_json``), so every
peer builds the same model, data shards and hyper-parameters.  Unknown keys and bad values raise
``ConfigError`` with one sentence that says what to fix.

The sections are in modules of their own (``model_config``, ``optim_config``, ``rounds_config``, ``log_config``;
shared checks in ``checks``); this module holds the whole run and its loading."""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from swarm.config.checks import (  # noqa: F401  (re-exported: the names this module has always had)
    MAX_BATCH,
    MAX_LR,
    MAX_PATH_CHARS,
    MAX_PEERS,
    MAX_ROUNDS,
    MAX_STEPS,
    MAX_TIMEOUT_S,
    ConfigError,
    check_range,
)
from swarm.config.log_config import WANDB_MODES, LoggingConfig, WandbConfig  # noqa: F401
from swarm.config.model_config import MODEL_PRESETS, TOKEN_DTYPES, DataConfig, ModelConfig  # noqa: F401
from swarm.config.optim_config import (  # noqa: F401
    LR_SCHEDULES,
    NESTEROV,
    PRECISIONS,
    SHARDINGS,
    InnerOptConfig,
    OuterOptConfig,
    outer_optimizer_names,
    torch_optimizer_kwargs,
)
from swarm.config.rounds_config import (  # noqa: F401
    AGGREGATIONS,
    CODEC_NAMES,
    CONTROLLERS,
    FRAGMENT_PATTERNS,
    LOWRANK_VALUES,
    RoundConfig,
    check_codec_name,
)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerOptConfig = field(default_factory=InnerOptConfig)
    outer: OuterOptConfig = field(default_factory=OuterOptConfig)
    rounds: RoundConfig = field(default_factory=RoundConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> "RunConfig":
        check_range("top level", "seed", self.seed, 0, 2**63 - 1)
        for section in (self.model, self.data, self.inner, self.outer, self.rounds, self.logging):
            section.validate()
        if self.inner.schedule != "constant" and self.rounds.max_rounds is None:
            raise ConfigError(
                f"[inner] schedule {self.inner.schedule!r} decays over the run's inner steps; set"
                ' [rounds] max_rounds (or give --max-rounds), or use schedule = "constant".'
            )
        if self.data.batch_size % self.inner.micro_batches:
            raise ConfigError(
                f"[inner] micro_batches {self.inner.micro_batches} must divide [data] batch_size"
                f" {self.data.batch_size}."
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, origin: str = "config") -> "RunConfig":
        return _build(cls, data, origin=origin, section="").validate()

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        return cls.from_dict(json.loads(text), origin="run spec")

    def replace(self, **sections: Any) -> "RunConfig":
        return dataclasses.replace(self, **sections)


MAX_CONFIG_BYTES = 1_000_000


def load_run_config(path: str | Path, *, overrides: Optional[dict[str, dict[str, Any]]] = None) -> RunConfig:
    """Read a run TOML file; every mistake becomes one ConfigError sentence. ``overrides`` ({section: {key:
    value}}: what the command line says, e.g. ``--max-rounds``) replace the file's values before the whole is
    checked, so that a check across keys (a decaying schedule needs max_rounds) sees them."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"config file {str(path)!r} is larger than {MAX_CONFIG_BYTES} bytes; give a run TOML file."
            )
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist; check the --config path.") from None
    except IsADirectoryError:
        raise ConfigError(f"config path {str(path)!r} is a directory; give the run TOML file inside it.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text; save it as UTF-8 TOML.") from None
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read ({e.strerror}); check its permissions.") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML ({e}); fix the syntax.") from None
    return RunConfig.from_dict(with_overrides(data, overrides), origin=str(path))


def with_overrides(data: dict[str, Any], overrides: Optional[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """A run table (as TOML gives it) with ``overrides`` ({section: {key: value}}) set in it."""
    data = dict(data)
    for section, values in (overrides or {}).items():
        table = data.get(section, {})
        data[section] = {**table, **values} if isinstance(table, dict) else table  # not a table: from_dict says so
    return data


def _build(cls: type, data: Any, *, origin: str, section: str) -> Any:
    where = f"[{section}]" if section else "the top level"
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: {where} must be a table, got {type(data).__name__}.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{origin}: unknown key {unknown[0]!r} in {where}; valid keys are {sorted(fields)}.")
    kwargs: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for name, value in data.items():
        default = getattr(cls(), name)
        if dataclasses.is_dataclass(default):
            kwargs[name] = _build(type(default), value, origin=origin, section=f"{section}.{name}" if section else name)
        elif (section, name) in _JSON_FIELDS:
            kwargs[name] = _json_value(value, name=name, origin=origin, where=where)
        elif value is None and type(None) in typing.get_args(hints[name]):
            kwargs[name] = None  # an Optional field switched off (JSON null; TOML has no null)
        else:
            kwargs[name] = _coerce(value, default, name=name, origin=origin, where=where)
    return cls(**kwargs)


# Free-form values (strings, numbers, booleans, lists, tables) handed to user code as they are.
_JSON_FIELDS = {("model", "hf_config"), ("model", "options")}


def _json_value(value: Any, *, name: str, origin: str, where: str) -> Any:
    if name == "hf_config" and not isinstance(value, (str, dict)):
        raise ConfigError(f"{origin}: hf_config in {where} must be a path to a config.json or an inline table.")
    if name == "options" and not isinstance(value, dict):
        raise ConfigError(f"{origin}: options in {where} must be a table, got {type(value).__name__}.")
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        raise ConfigError(
            f"{origin}: {name} in {where} holds a value JSON cannot carry (a date, NaN); use strings and numbers."
        ) from None


def _coerce(value: Any, default: Any, *, name: str, origin: str, where: str) -> Any:
    bad = ConfigError(
        f"{origin}: {name} in {where} has the wrong type {type(value).__name__}"
        f" ({value!r}); expected {type(default).__name__ if default is not None else 'an integer or nothing'}."
    )
    if default is None:  # the optional fields (context, max_rounds) are integers that default to None
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        raise bad
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise bad
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise bad
        return value
    if isinstance(default, tuple):  # a list of names, e.g. controller_codecs
        if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) for x in value):
            raise ConfigError(f"{origin}: {name} in {where} must be a list of strings, got {value!r}.")
        return tuple(value)
    if isinstance(default, dict):  # a sub-table of keyword arguments, e.g. [outer.options]
        if not isinstance(value, dict):
            raise bad
        out = {}
        for key, item in value.items():
            number = (int, float)
            ok = isinstance(item, (bool, int, float)) or (
                isinstance(item, (list, tuple)) and all(isinstance(x, number) and not isinstance(x, bool) for x in item)
            )
            if not isinstance(key, str) or not ok:
                raise ConfigError(
                    f"{origin}: {name}.{key} in {where} must be a number, a boolean or a list of numbers, got {item!r}."
                )
            out[key] = list(item) if isinstance(item, (list, tuple)) else item
        return out
    raise bad
