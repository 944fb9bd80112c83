"""The `swarm` command: coordinator, peer, status and demo (its parser: swarm.app.cli_parser).

swarm coordinator [--config run.toml] [--host 0.0.0.0] [--port 0] [--state-dir DIR] [--max-rounds N]
swarm peer --join 'swarm://...' [--device cpu|cuda] [--state-dir DIR] [--site LABEL]
swarm status 'swarm://...' [--json] [--watch [--interval S] [--count N]]
swarm history 'swarm://...'|STATE_DIR [--csv|--json]
swarm token create|list|revoke --state-dir DIR [...]
swarm demo [--peers 3] [--rounds N] [--json]
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Optional, Sequence

from swarm.app.cli_parser import build_parser
from swarm.app.flag_validation import validate_args
from swarm.config import ConfigError, RunConfig, load_run_config
from swarm.config.model_sources import check_model_sources
from swarm.net.bulk.tcp_congestion import CONGESTION_CONTROL


def _setup_logging(verbose: bool) -> None:
    """Logs on stderr, and every thread's stack there on SIGUSR1 (`kill -USR1 PID`: where a hung process is)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, ValueError, OSError):  # no SIGUSR1 here, or stderr is not a file (captured)
        pass


def _run_config(args: argparse.Namespace) -> RunConfig:
    """The run TOML (or the embedded default) with the command line's overrides, checked as a whole."""
    from swarm.config.run import with_overrides

    rounds = {
        key: getattr(args, key) for key in ("max_rounds", "min_peers", "inner_steps") if getattr(args, key) is not None
    }
    overrides = {"rounds": rounds, **({"model": {"preset": args.preset}} if args.preset is not None else {})}
    if args.config:
        return load_run_config(args.config, overrides=overrides)
    return RunConfig.from_dict(with_overrides({}, overrides), origin="the command line")


def cmd_coordinator(args: argparse.Namespace) -> int:
    run = _run_config(args)  # config mistakes are reported before the slow imports
    check_model_sources(run.model)  # a misspelt hf_config path or factory module too (the rest: before the data)
    run.rounds.check_real_swarm()

    from coordinator.server import serve

    return serve(
        run=run,
        state_dir=Path(args.state_dir),
        host=args.host,
        port=args.port,
        dht_port=args.dht_port,
        announce_host=args.announce_host,
        lease_s=args.lease_s,
        config_given=args.config is not None,
        max_rounds=args.max_rounds,
        exit_grace_s=args.exit_grace_s,
        http_port=args.http_port,
        http_host=args.http_host,
        linger_s=args.linger_s,
    )


def cmd_peer(args: argparse.Namespace) -> int:
    from swarm.control.joinstring import JoinString

    join = JoinString.parse(args.join)  # a malformed join string is reported before the slow imports
    from peer.faults import FaultPlan

    faults = FaultPlan.parse(args.faults or os.environ.get("SWARM_FAULTS", ""))

    from peer.options import PeerOptions

    options = PeerOptions(
        join=join,
        device=args.device,
        nproc=args.nproc,
        state_dir=Path(args.state_dir),
        site=args.site,
        name=args.name,
        threads=args.threads,
        p2p_host=args.p2p_host,
        p2p_port=args.p2p_port,
        announce_host=args.announce_host,
        uplink_mbit=args.uplink_mbit,
        tcp_congestion=args.tcp_congestion or CONGESTION_CONTROL,
        join_timeout_s=args.join_timeout_s,
        faults=faults,
        checkpoint_every_rounds=args.checkpoint_every,
        final_serve_s=args.final_serve_s,
    )

    def run() -> int:
        from peer.run import run_peer

        _check_devices(args)
        return run_peer(options, metrics_port=args.metrics_port)

    if not args.max_restarts:
        return run()
    from peer.ranks import torchrun_rank
    from peer.restarts import supervise

    if torchrun_rank() is not None:
        raise ConfigError("--max-restarts restarts a peer swarm started; under torchrun, use torchrun's own instead.")
    return supervise(lambda: _reported(args, run), max_restarts=args.max_restarts)


def _check_devices(args: argparse.Namespace) -> None:
    """--device and --nproc against the GPUs torch sees (in the process that trains: see peer/restarts.py)."""
    kind = args.device.split(":")[0]
    if kind in ("mps", "xpu"):
        import torch

        backend = torch.backends.mps if kind == "mps" else getattr(torch, "xpu", None)
        if backend is None or not backend.is_available():
            raise ConfigError(
                f"--device {args.device} was asked for but torch sees no {kind} device; use --device cpu."
            )
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"--device {args.device} was asked for but torch sees no CUDA device; use --device cpu.")
        first = torch.device(args.device).index or 0
        if first + args.nproc > torch.cuda.device_count():
            raise ConfigError(
                f"--nproc {args.nproc} from --device {args.device} needs GPUs up to cuda:"
                f"{first + args.nproc - 1}, but torch sees {torch.cuda.device_count()}; lower --nproc."
            )


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from swarm.app.status import fetch_all_pages, print_status, status_to_dict, watch
    from swarm.control.client import CoordinatorClient
    from swarm.control.joinstring import JoinString

    client = CoordinatorClient(JoinString.parse(args.join))
    try:

        def fetch():
            pages = fetch_all_pages(lambda token: client.get_status(page_token=token), max_peers=args.max_peers or None)
            return status_to_dict(pages)

        console = Console()
        if args.watch or args.count is not None:
            try:
                watch(fetch, interval_s=args.interval, console=console, count=args.count, as_json=args.json)
            except KeyboardInterrupt:
                pass
            return 0
        print_status(fetch(), as_json=args.json, console=console)
        return 0
    finally:
        client.close()


def cmd_history(args: argparse.Namespace) -> int:
    from rich.console import Console

    from swarm.app.history import fetch_history, history_from_state_dir, history_to_dict, print_history

    if args.source.startswith("swarm://"):
        from swarm.control.client import CoordinatorClient
        from swarm.control.joinstring import JoinString

        with CoordinatorClient(JoinString.parse(args.source)) as client:
            history = fetch_history(lambda after: client.get_history(after_round=after))
    else:
        history = history_from_state_dir(Path(args.source))
    print_history(
        history_to_dict(history), fmt="csv" if args.csv else "json" if args.json else "table", console=Console()
    )
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from swarm.app.history import serve_dashboard

    return serve_dashboard(Path(args.state_dir), host=args.http_host, port=args.http_port)


def cmd_token(args: argparse.Namespace) -> int:
    import time

    from swarm.app import token_admin

    state_dir = Path(args.state_dir)
    if args.action == "create":
        print(
            token_admin.create(
                state_dir,
                role=args.role,
                expires=args.expires,
                max_uses=args.max_uses,
                site=args.site,
                max_identities=args.max_identities,
            )
        )
    elif args.action == "list":
        now = time.time()
        for record, live in token_admin.list_tokens(state_dir):
            print(token_admin.describe(record, now=now, live=live))
    else:
        record = token_admin.revoke(state_dir, args.id)
        print(f"revoked {record.id}: it admits nobody now, and its peers are evicted at their next call")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from swarm.app.demo import DemoOptions, run_demo

    return run_demo(
        DemoOptions(
            peers=args.peers,
            rounds=args.rounds,
            inner_steps=args.inner_steps,
            preset=args.preset,
            as_json=args.json,
            workdir=Path(args.state_dir) if args.state_dir else None,
            timeout_s=args.timeout,
        )
    )


def cmd_export(args: argparse.Namespace) -> int:
    from swarm.app.export import export

    result = export(
        Path(args.state_dir), Path(args.out_dir), tokenizer=Path(args.tokenizer) if args.tokenizer else None
    )
    for note in result.notes:
        print(f"swarm export: {note}", file=sys.stderr)
    print(f"exported {result.weights}" + (f" and {result.tokenizer}" if result.tokenizer else ""))
    return 0


COMMANDS = {
    "coordinator": cmd_coordinator,
    "peer": cmd_peer,
    "status": cmd_status,
    "history": cmd_history,
    "dashboard": cmd_dashboard,
    "token": cmd_token,
    "demo": cmd_demo,
    "export": cmd_export,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = validate_args(args)
    if problem is not None:
        parser.error(problem)  # usage and the sentence on stderr, exit 2
    _setup_logging(args.verbose)
    return _reported(args, lambda: int(COMMANDS[args.command](args) or 0))


def _reported(args: argparse.Namespace, command) -> int:
    """Run ``command``; a user's mistake (bad config, join string, token, fault spec) is one sentence on stderr
    and exit 2."""
    from peer.faults import FaultSpecError
    from swarm.control.client import CoordinatorError
    from swarm.control.joinstring import JoinStringError

    try:
        return command()
    except (ConfigError, JoinStringError, CoordinatorError, FaultSpecError) as e:
        print(f"swarm {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `swarm status --watch | head`: the reader is gone, which is not an error
        _quiet_stdout()
        return 0


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit does not fail again on the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is not a file (captured)
        pass


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
