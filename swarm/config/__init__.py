"""The run's configuration: a leaf layer (imports nothing else from swarm)."""

from swarm.config.run import (  # noqa: F401
    ConfigError,
    CODEC_NAMES,
    FRAGMENT_PATTERNS,
    AGGREGATIONS,
    MODEL_PRESETS,
    NESTEROV,
    outer_optimizer_names,
    torch_optimizer_kwargs,
    ModelConfig,
    DataConfig,
    InnerOptConfig,
    OuterOptConfig,
    RoundConfig,
    RunConfig,
    load_run_config,
)

__all__ = [
    "ConfigError",
    "CODEC_NAMES",
    "FRAGMENT_PATTERNS",
    "AGGREGATIONS",
    "MODEL_PRESETS",
    "NESTEROV",
    "outer_optimizer_names",
    "torch_optimizer_kwargs",
    "ModelConfig",
    "DataConfig",
    "InnerOptConfig",
    "OuterOptConfig",
    "RoundConfig",
    "RunConfig",
    "load_run_config",
]
