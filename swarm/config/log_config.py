"""[logging]: the training logs for TensorBoard and Weights & Biases."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from swarm.config.checks import ConfigError, check_dir

WANDB_MODES = ("offline", "online")
_WANDB_PROJECT = re.compile(r"[\w.-]{1,128}")


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """Weights & Biases logging; an empty project switches it off."""

    project: str = ""
    mode: str = "offline"  # "offline": files only (``wandb sync`` uploads them later); "online": upload as it runs
    entity: str = ""  # the W&B team or user (empty: the logged-in user's default)
    dir: str = "wandb"  # where run files go: <dir>/<peer name or id>, <dir>/coordinator

    def validate(self) -> None:
        if not self.project:
            if self.entity or self.mode != "offline" or self.dir != "wandb":
                raise ConfigError('[logging] wandb needs a project, e.g. wandb = { project = "my-run" }.')
            return
        if not _WANDB_PROJECT.fullmatch(self.project):
            raise ConfigError(
                f"[logging] wandb project must be 1 to 128 letters, digits, '.', '-' or '_', got {self.project!r}."
            )
        if self.mode not in WANDB_MODES:
            raise ConfigError(f"[logging] wandb mode {self.mode!r} is unknown; choose one of {list(WANDB_MODES)}.")
        if self.entity and not _WANDB_PROJECT.fullmatch(self.entity):
            raise ConfigError(f"[logging] wandb entity must be letters, digits, '.', '-' or '_', got {self.entity!r}.")
        check_dir("wandb dir", self.dir)


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Training logs for the tools ML engineers use; each writer is an optional extra (``pip install
    swarm-train[tensorboard]`` / ``[wandb]``). Every peer logs under ``<dir>/<its name or id>``, the
    coordinator under ``<dir>/coordinator``, each on its own machine."""

    tensorboard: str = ""  # a directory for TensorBoard event files (empty: off)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def validate(self) -> None:
        if self.tensorboard:
            check_dir("tensorboard", self.tensorboard)
        self.wandb.validate()
