"""The `swarm` command: coordinator, peer, status and demo.

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

from swarm.app.flag_validation import validate_args
from swarm.config import ConfigError, RunConfig, load_run_config
from swarm.config.model_sources import check_model_sources
from swarm.config.rounds_config import simulator_only
from swarm.net.tcp_congestion import CONGESTION_CONTROL, SYSTEM


def _setup_logging(verbose: bool) -> None:
    """Logs on stderr, and every thread's stack there on SIGUSR1 (`kill -USR1 PID`: where a hung process is)."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, ValueError, OSError):  # no SIGUSR1 here, or stderr is not a file (captured)
        pass


def _run_config(args: argparse.Namespace) -> RunConfig:
    """The run TOML (or the embedded default) with the command line's overrides, checked as a whole."""
    from swarm.config.run import with_overrides

    rounds = {key: getattr(args, key) for key in ("max_rounds", "min_peers", "inner_steps")
              if getattr(args, key) is not None}
    overrides = {"rounds": rounds, **({"model": {"preset": args.preset}} if args.preset is not None else {})}
    if args.config:
        return load_run_config(args.config, overrides=overrides)
    return RunConfig.from_dict(with_overrides({}, overrides), origin="the command line")


def cmd_coordinator(args: argparse.Namespace) -> int:
    run = _run_config(args)  # config mistakes are reported before the slow imports
    check_model_sources(run.model)  # a misspelt hf_config path or factory module too (the rest: before the data)
    if simulator_only(run.rounds.codec):
        raise ConfigError(f"[rounds] codec {run.rounds.codec} runs only in the simulator so far (python -m swarm.train.sim,"
                          " scripts/bench_quality.py); a real swarm cannot exchange it yet: choose int4 or sign.")

    from coordinator.server import serve
    return serve(
        run=run,
        state_dir=Path(args.state_dir),
        host=args.host, port=args.port, dht_port=args.dht_port,
        announce_host=args.announce_host,
        lease_s=args.lease_s,
        config_given=args.config is not None, max_rounds=args.max_rounds,
        exit_grace_s=args.exit_grace_s,
        http_port=args.http_port, http_host=args.http_host, linger_s=args.linger_s,
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
            raise ConfigError(f"--device {args.device} was asked for but torch sees no {kind} device; use --device cpu.")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"--device {args.device} was asked for but torch sees no CUDA device; use --device cpu.")
        first = torch.device(args.device).index or 0
        if first + args.nproc > torch.cuda.device_count():
            raise ConfigError(f"--nproc {args.nproc} from --device {args.device} needs GPUs up to cuda:"
                              f"{first + args.nproc - 1}, but torch sees {torch.cuda.device_count()}; lower --nproc.")


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from swarm.app.status import fetch_all_pages, print_status, status_to_dict, watch
    from swarm.control.client import CoordinatorClient
    from swarm.control.joinstring import JoinString

    client = CoordinatorClient(JoinString.parse(args.join))
    try:
        fetch = lambda: status_to_dict(fetch_all_pages(  # noqa: E731
            lambda token: client.get_status(page_token=token), max_peers=args.max_peers or None))
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
    print_history(history_to_dict(history), fmt="csv" if args.csv else "json" if args.json else "table",
                  console=Console())
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from swarm.app.history import serve_dashboard

    return serve_dashboard(Path(args.state_dir), host=args.http_host, port=args.http_port)


def cmd_token(args: argparse.Namespace) -> int:
    import time

    from swarm.app import token_admin

    state_dir = Path(args.state_dir)
    if args.action == "create":
        print(token_admin.create(state_dir, role=args.role, expires=args.expires, max_uses=args.max_uses,
                                 site=args.site, max_identities=args.max_identities))
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

    return run_demo(DemoOptions(
        peers=args.peers, rounds=args.rounds, inner_steps=args.inner_steps, preset=args.preset,
        as_json=args.json, workdir=Path(args.state_dir) if args.state_dir else None, timeout_s=args.timeout,
    ))


def cmd_export(args: argparse.Namespace) -> int:
    from swarm.app.export import export

    result = export(Path(args.state_dir), Path(args.out_dir), tokenizer=Path(args.tokenizer) if args.tokenizer else None)
    for note in result.notes:
        print(f"swarm export: {note}", file=sys.stderr)
    print(f"exported {result.weights}" + (f" and {result.tokenizer}" if result.tokenizer else ""))
    return 0


def _add_history_parsers(sub) -> None:
    h = sub.add_parser("history", help="a run's rounds, from a live coordinator or a finished run's state dir")
    h.add_argument("source", metavar="JOIN_OR_STATE_DIR", help="the run's join string, or the coordinator's --state-dir")
    fmt = h.add_mutually_exclusive_group()
    fmt.add_argument("--csv", action="store_true", help="print CSV, one line per round")
    fmt.add_argument("--json", action="store_true", help="print one JSON object (rounds and per-peer rows)")
    h.set_defaults(func=cmd_history)

    w = sub.add_parser("dashboard", help="serve the dashboard of a finished (or running) run from its state dir")
    w.add_argument("state_dir", metavar="STATE_DIR", help="the coordinator's --state-dir")
    w.add_argument("--http-port", type=int, default=0, help="port for the page and /metrics (0: any free port)")
    w.add_argument("--http-host", default="127.0.0.1", help="address to listen on (127.0.0.1: loopback only)")
    w.set_defaults(func=cmd_dashboard)


def _add_token_parser(sub) -> None:
    t = sub.add_parser("token", help="create, list or revoke a run's join tokens (on the coordinator's machine)")
    actions = t.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="print a join string with a new token")
    create.add_argument("--role", choices=("peer", "status"), default="peer",
                        help="peer: may join the run; status: may only watch it (swarm status)")
    create.add_argument("--expires", help="refuse joins after this long, e.g. 30m, 24h, 7d (default: never)")
    create.add_argument("--max-uses", type=int, help="admit at most this many joins (default: no limit)")
    create.add_argument("--site", default="", help="pin the site of every peer that joins with it")
    create.add_argument("--max-identities", type=int, default=1, metavar="N",
                        help="peer identities (keys) it may hold at once; a restarted peer keeps its own "
                             "(default: 1, one machine's peer)")
    actions.add_parser("list", help="the run's tokens, their roles, uses, live identities / limit and state")
    revoke = actions.add_parser("revoke", help="stop a token: no more joins, its peers are evicted")
    revoke.add_argument("id", help="the token's id (see swarm token list)")
    for action in (create, actions.choices["list"], revoke):
        action.add_argument("--state-dir", default="swarm-coordinator", help="the coordinator's --state-dir")
    t.set_defaults(func=cmd_token)


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless it names one itself or has none worth saying
    (None, "", a flag that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "(default" in text or not action.option_strings or default is None or default is False \
                or default == "" or default is argparse.SUPPRESS:
            return text
        return text + " (default: %(default)s)"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("swarm-train")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm", description="Train one model on many poorly connected computers.",
                                     formatter_class=_HelpWithDefaults)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"swarm {_version()}",
                        help="print the installed Swarm release and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_coordinator_parser(sub)
    _add_peer_parser(sub)
    _add_token_parser(sub)
    _add_watch_parsers(sub)
    _add_history_parsers(sub)
    _with_defaults_in_help(parser)
    return parser


def _with_defaults_in_help(parser: argparse.ArgumentParser) -> None:
    """``parser`` and every subcommand under it show each option's default in their --help."""
    parser.formatter_class = _HelpWithDefaults
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _with_defaults_in_help(child)


def _add_coordinator_parser(sub) -> None:
    c = sub.add_parser("coordinator", help="start a run and print its join string")
    c.add_argument("--config", help="run TOML file (default: the embedded byte-level GPT on the stdlib corpus)")
    c.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    c.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    c.add_argument("--dht-port", type=int, default=0, help="hivemind DHT port (0: any free port)")
    c.add_argument("--announce-host", help="address peers should use to reach this host, when --host is 0.0.0.0")
    c.add_argument("--state-dir", default="swarm-coordinator", help="where the SQLite state, TLS key and join string live")
    c.add_argument("--max-rounds", type=int, help="finish the run after this many committed rounds; on a finished run's "
                   "--state-dir, a larger number extends it (default: the run TOML's [rounds] max_rounds)")
    c.add_argument("--min-peers", type=int,
                   help="open each round once this many peers are ready (default: the run TOML's [rounds] min_peers)")
    c.add_argument("--inner-steps", type=int, help="H: inner steps per round (default: the run TOML's [rounds] inner_steps)")
    c.add_argument("--preset", help="model preset: tiny, small, medium, gpt2 (default: the run TOML's [model] preset)")
    c.add_argument("--lease-s", type=float, default=15.0, help="evict a peer after this many seconds without heartbeat")
    c.add_argument("--exit-grace-s", type=float, default=2.0,
                   help="after the run finished and its peers left, keep answering status this long")
    c.add_argument("--http-port", type=int, help="serve the dashboard and /metrics on this port (0: any free port)")
    c.add_argument("--http-host", default="127.0.0.1", help="address for the dashboard (127.0.0.1: loopback only)")
    c.add_argument("--linger-s", type=float, default=0.0,
                   help="with --http-port: keep the finished run's dashboard up this many seconds more")
    c.set_defaults(func=cmd_coordinator)


def _add_peer_parser(sub) -> None:
    p = sub.add_parser("peer", help="lend this machine to a run")
    p.add_argument("--join", required=True, help="the join string printed by `swarm coordinator`")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--nproc", type=int, default=1, help="data-parallel ranks in this peer (one per GPU from --device)")
    p.add_argument("--state-dir", default="swarm-peer", help="where the final model and checkpoints go")
    p.add_argument("--site", default="", help="a label for this machine's location (datacenter, lab)")
    p.add_argument("--name", default="", help="a human-readable name (default: hostname)")
    p.add_argument("--threads", type=int, help="torch threads for training (default: torch's choice)")
    p.add_argument("--p2p-host", help="address to listen on for peers (default: all; loopback if the coordinator is)")
    p.add_argument("--p2p-port", type=int, default=0, help="port for the peer-to-peer transport (0: any)")
    p.add_argument("--announce-host", help="address other peers reach this one at (default: its route to the coordinator)")
    p.add_argument("--uplink-mbit", type=float, default=0.0,
                   help="this machine's upload rate in Mbit/s, if known: the exchange paces its sends just under it, "
                        "so that they do not overrun the link's queue (default 0: unpaced)")
    p.add_argument("--tcp-congestion", metavar="NAME",
                   help=f"TCP congestion control of the bulk connections (default {CONGESTION_CONTROL}: the K - 1 "
                        f"flows into each groupmate share its link evenly; '{SYSTEM}': the system's default)")
    p.add_argument("--join-timeout-s", type=float, default=120.0,
                   help="give up (exit 2) when the coordinator stays unreachable this long at start")
    p.add_argument("--checkpoint-every", type=int, default=5,
                   help="write a checkpoint to <state-dir>/checkpoint every N committed rounds, and each round's "
                        "vote to <state-dir>/vote before reporting it (0: a checkpoint only at exit, no votes)")
    p.add_argument("--final-serve-s", type=float, default=30.0,
                   help="when the run finishes, keep serving the final state this long at most while peers "
                        "still download it")
    p.add_argument("--max-restarts", type=int, default=0, help="when the peer process dies (a crash, an OOM kill), "
                   "fork it again at once from a parent that keeps the imports loaded, this many times at most")
    p.add_argument("--faults", help="fault injection for tests, e.g. 'crash@3:sending,delay@2:reported=5' "
                                    "(see peer/faults.py); also read from SWARM_FAULTS")
    p.add_argument("--metrics-port", type=int,
                   help="serve this peer's metrics for Prometheus at http://127.0.0.1:PORT/metrics (0: any free port)")
    p.set_defaults(func=cmd_peer)


def _add_watch_parsers(sub) -> None:
    """status, demo and export: watching a run, trying one, taking its model away."""
    s = sub.add_parser("status", help="show how a run is doing")
    s.add_argument("join", help="the run's join string")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--watch", action="store_true",
                   help="refresh live until the run finishes (piped, or with --json: print a snapshot every interval)")
    s.add_argument("--interval", type=float, default=2.0, help="refresh period for --watch, seconds")
    s.add_argument("--count", type=int, help="with --watch: stop after this many snapshots (implies --watch; "
                   "default: until the run finishes or Ctrl-C)")
    s.add_argument("--max-peers", type=int, default=200,
                   help="list at most this many peers, by index (0: every peer; a large swarm's take many pages)")
    s.set_defaults(func=cmd_status)

    d = sub.add_parser("demo", help="a coordinator and peers on this machine, training the embedded default")
    d.add_argument("--peers", type=int, default=3, help="how many peers to start on this machine")
    d.add_argument("--rounds", type=int, default=10, help="finish the run after this many committed rounds")
    d.add_argument("--inner-steps", type=int, default=50, help="H: inner steps each peer trains per round")
    d.add_argument("--preset", default="tiny", help="model preset (tiny, small, medium, gpt2)")
    d.add_argument("--state-dir", help="keep the run's files here (default: a temporary directory)")
    d.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds")
    d.add_argument("--json", action="store_true", help="end with one JSON line summarising the run")
    d.set_defaults(func=cmd_demo)

    e = sub.add_parser("export", help="a finished peer's final model as a Hugging Face directory or a safetensors file")
    e.add_argument("state_dir", help="the peer's --state-dir (it holds final/model.safetensors)")
    e.add_argument("out_dir", help="where to write it (created when missing)")
    e.add_argument("--tokenizer", metavar="TOKENIZER_JSON",
                   help="the tokenizer.json to export with the model (default: the run's [data] tokenizer, found as "
                        "named or beside the state dir; none for a run on bytes or token files)")
    e.set_defaults(func=cmd_export)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = validate_args(args)
    if problem is not None:
        parser.error(problem)  # usage and the sentence on stderr, exit 2
    _setup_logging(args.verbose)
    return _reported(args, lambda: int(args.func(args) or 0))


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
