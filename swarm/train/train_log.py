"""Training logs for TensorBoard and Weights & Biases ([logging] in the run config): scalars by round, from a
peer (its loss, throughput, bytes) or from the coordinator (the run's curves).

Each writer is an optional extra. One that is configured but not installed, or that fails to start, is
skipped with one warning sentence: a run never stops for its logs.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol

from swarm.config import LoggingConfig

logger = logging.getLogger(__name__)

COORDINATOR_NAME = "coordinator"  # the coordinator's log directory under [logging] tensorboard and wandb dir
WANDB_STEP = "round"  # W&B's x axis: every metric is plotted against it, so a late evaluation still lands


class ScalarWriter(Protocol):
    def write(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TrainLog:
    """Scalars by step to every writer that is on; nothing at all when none is. Thread-safe: a peer logs from
    its main thread, the coordinator under its engine's lock."""

    def __init__(self, writers: list[ScalarWriter]) -> None:
        self._writers = writers
        self._lock = threading.Lock()

    @property
    def on(self) -> bool:
        return bool(self._writers)

    def log(self, step: int, scalars: Mapping[str, Optional[float]]) -> None:
        """Write the finite values of ``scalars`` at ``step`` (NaN and None mean "not measured")."""
        finite = {k: float(v) for k, v in scalars.items() if v is not None and math.isfinite(v)}
        if not finite or not self._writers:
            return
        with self._lock:
            for writer in list(self._writers):
                try:
                    writer.write(step, finite)
                except Exception as e:  # a full disk or a writer's own failure must not stop training
                    logger.warning("training log %s failed (%s); it is off from now on", type(writer).__name__, e)
                    self._writers.remove(writer)

    def close(self) -> None:
        with self._lock:
            writers, self._writers = self._writers, []
        for writer in writers:
            try:
                writer.close()
            except Exception as e:
                logger.warning("training log %s did not close cleanly (%s)", type(writer).__name__, e)


def log_dir_name(name: str) -> str:
    """``name`` as one safe path component: a peer's name comes from its command line, or its id."""
    cleaned = re.sub(r"[^\w.-]", "_", name)[:100].strip(".")
    return cleaned or "unnamed"


def open_train_log(
    config: LoggingConfig, *, name: str, group: str = "", run_config: Optional[Mapping[str, Any]] = None
) -> TrainLog:
    """The writers ``config`` asks for, logging as ``name`` (a peer's name or id, or "coordinator") under
    their directories; ``group`` (the run id) groups a run's W&B runs."""
    writers: list[ScalarWriter] = []
    component = log_dir_name(name)
    if config.tensorboard:
        writer = _tensorboard(Path(config.tensorboard) / component)
        if writer is not None:
            writers.append(writer)
    if config.wandb.project:
        writer = _wandb(config, name=component, group=group, run_config=run_config)
        if writer is not None:
            writers.append(writer)
    return TrainLog(writers)


class TensorBoardWriter:
    def __init__(self, summary_writer: Any) -> None:
        self._writer = summary_writer

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()  # once a round: the curves are current while the run trains

    def close(self) -> None:
        self._writer.close()


def _tensorboard(log_dir: Path) -> Optional[TensorBoardWriter]:
    try:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
    except ImportError:
        logger.warning(
            "[logging] tensorboard is set but the tensorboard package is not installed; install it with"
            " pip install 'swarm-train[tensorboard]' (no TensorBoard events are written)"
        )
        return None
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        return TensorBoardWriter(SummaryWriter(log_dir=str(log_dir)))
    except OSError as e:
        logger.warning(
            "[logging] tensorboard directory %s cannot be written (%s); no TensorBoard events are written",
            log_dir,
            e.strerror or e,
        )
        return None


class WandbWriter:
    def __init__(self, run: Any) -> None:
        self._run = run

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log({**scalars, WANDB_STEP: step})

    def close(self) -> None:
        self._run.finish()


def _wandb(
    config: LoggingConfig, *, name: str, group: str, run_config: Optional[Mapping[str, Any]]
) -> Optional[WandbWriter]:
    try:
        import wandb
    except ImportError:
        logger.warning(
            "[logging] wandb is set but the wandb package is not installed; install it with"
            " pip install 'swarm-train[wandb]' (nothing is logged to W&B)"
        )
        return None
    settings = config.wandb
    run_dir = Path(settings.dir) / name
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        run = wandb.init(
            project=settings.project,
            entity=settings.entity or None,
            mode=settings.mode,
            dir=str(run_dir),
            name=name,
            group=group or None,
            config=dict(run_config or {}),
            reinit="create_new",
        )
        run.define_metric(WANDB_STEP)
        run.define_metric("*", step_metric=WANDB_STEP)
    except Exception as e:  # wandb raises its own errors (no login for online mode, a bad entity)
        logger.warning("[logging] wandb could not start a run in %s (%s); nothing is logged to W&B", run_dir, e)
        return None
    return WandbWriter(run)
