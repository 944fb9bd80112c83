"""The `swarm` command line's parser: its subcommands, their options and what --help says of them (each
option's default included). ``swarm.app.cli`` runs what it parses."""

from __future__ import annotations

import argparse

from swarm.net.bulk.tcp_congestion import CONGESTION_CONTROL, SYSTEM


def _add_history_parsers(sub) -> None:
    h = sub.add_parser("history", help="a run's rounds, from a live coordinator or a finished run's state dir")
    h.add_argument(
        "source", metavar="JOIN_OR_STATE_DIR", help="the run's join string, or the coordinator's --state-dir"
    )
    fmt = h.add_mutually_exclusive_group()
    fmt.add_argument("--csv", action="store_true", help="print CSV, one line per round")
    fmt.add_argument("--json", action="store_true", help="print one JSON object (rounds and per-peer rows)")

    w = sub.add_parser("dashboard", help="serve the dashboard of a finished (or running) run from its state dir")
    w.add_argument("state_dir", metavar="STATE_DIR", help="the coordinator's --state-dir")
    w.add_argument("--http-port", type=int, default=0, help="port for the page and /metrics (0: any free port)")
    w.add_argument("--http-host", default="127.0.0.1", help="address to listen on (127.0.0.1: loopback only)")


def _add_token_parser(sub) -> None:
    t = sub.add_parser("token", help="create, list or revoke a run's join tokens (on the coordinator's machine)")
    actions = t.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="print a join string with a new token")
    create.add_argument(
        "--role",
        choices=("peer", "status"),
        default="peer",
        help="peer: may join the run; status: may only watch it (swarm status)",
    )
    create.add_argument("--expires", help="refuse joins after this long, e.g. 30m, 24h, 7d (default: never)")
    create.add_argument("--max-uses", type=int, help="admit at most this many joins (default: no limit)")
    create.add_argument("--site", default="", help="pin the site of every peer that joins with it")
    create.add_argument(
        "--max-identities",
        type=int,
        default=1,
        metavar="N",
        help="peer identities (keys) it may hold at once; a restarted peer keeps its own "
        "(default: 1, one machine's peer)",
    )
    actions.add_parser("list", help="the run's tokens, their roles, uses, live identities / limit and state")
    revoke = actions.add_parser("revoke", help="stop a token: no more joins, its peers are evicted")
    revoke.add_argument("id", help="the token's id (see swarm token list)")
    for action in (create, actions.choices["list"], revoke):
        action.add_argument("--state-dir", default="swarm-coordinator", help="the coordinator's --state-dir")


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless it names one itself or has none worth saying
    (None, "", a flag that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "(default" in text
            or not action.option_strings
            or default is None
            or default is False
            or default == ""
            or default is argparse.SUPPRESS
        ):
            return text
        return text + " (default: %(default)s)"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("swarm-train")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm",
        description="Train one model on many poorly connected computers.",
        formatter_class=_HelpWithDefaults,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--version", action="version", version=f"swarm {_version()}", help="print the installed Swarm release and exit"
    )
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
    c.add_argument(
        "--state-dir", default="swarm-coordinator", help="where the SQLite state, TLS key and join string live"
    )
    c.add_argument(
        "--max-rounds",
        type=int,
        help="finish the run after this many committed rounds; on a finished run's "
        "--state-dir, a larger number extends it (default: the run TOML's [rounds] max_rounds)",
    )
    c.add_argument(
        "--min-peers",
        type=int,
        help="open each round once this many peers are ready (default: the run TOML's [rounds] min_peers)",
    )
    c.add_argument(
        "--inner-steps", type=int, help="H: inner steps per round (default: the run TOML's [rounds] inner_steps)"
    )
    c.add_argument("--preset", help="model preset: tiny, small, medium, gpt2 (default: the run TOML's [model] preset)")
    c.add_argument("--lease-s", type=float, default=15.0, help="evict a peer after this many seconds without heartbeat")
    c.add_argument(
        "--exit-grace-s",
        type=float,
        default=2.0,
        help="after the run finished and its peers left, keep answering status this long",
    )
    c.add_argument("--http-port", type=int, help="serve the dashboard and /metrics on this port (0: any free port)")
    c.add_argument("--http-host", default="127.0.0.1", help="address for the dashboard (127.0.0.1: loopback only)")
    c.add_argument(
        "--linger-s",
        type=float,
        default=0.0,
        help="with --http-port: keep the finished run's dashboard up this many seconds more",
    )


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
    p.add_argument(
        "--announce-host", help="address other peers reach this one at (default: its route to the coordinator)"
    )
    p.add_argument(
        "--uplink-mbit",
        type=float,
        default=0.0,
        help="this machine's upload rate in Mbit/s, if known: the exchange paces its sends just under it, "
        "so that they do not overrun the link's queue (default 0: unpaced)",
    )
    p.add_argument(
        "--tcp-congestion",
        metavar="NAME",
        help=f"TCP congestion control of the bulk connections (default {CONGESTION_CONTROL}: the K - 1 "
        f"flows into each groupmate share its link evenly; '{SYSTEM}': the system's default)",
    )
    p.add_argument(
        "--join-timeout-s",
        type=float,
        default=120.0,
        help="give up (exit 2) when the coordinator stays unreachable this long at start",
    )
    _add_peer_state_args(p)


def _add_peer_state_args(p) -> None:
    """The peer's state on disk, its end and restarts, and what it shows: checkpoints, votes, the final serve."""
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=5,
        help="write a checkpoint to <state-dir>/checkpoint every N committed rounds, and each round's "
        "vote to <state-dir>/vote before reporting it (0: a checkpoint only at exit, no votes)",
    )
    p.add_argument(
        "--final-serve-s",
        type=float,
        default=30.0,
        help="when the run finishes, keep serving the final state this long at most while peers still download it",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="when the peer process dies (a crash, an OOM kill), "
        "fork it again at once from a parent that keeps the imports loaded, this many times at most",
    )
    p.add_argument(
        "--faults",
        help="fault injection for tests, e.g. 'crash@3:sending,delay@2:reported=5' "
        "(see peer/faults.py); also read from SWARM_FAULTS",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve this peer's metrics for Prometheus at http://127.0.0.1:PORT/metrics (0: any free port)",
    )


def _add_watch_parsers(sub) -> None:
    """status, demo and export: watching a run, trying one, taking its model away."""
    s = sub.add_parser("status", help="show how a run is doing")
    s.add_argument("join", help="the run's join string")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument(
        "--watch",
        action="store_true",
        help="refresh live until the run finishes (piped, or with --json: print a snapshot every interval)",
    )
    s.add_argument("--interval", type=float, default=2.0, help="refresh period for --watch, seconds")
    s.add_argument(
        "--count",
        type=int,
        help="with --watch: stop after this many snapshots (implies --watch; "
        "default: until the run finishes or Ctrl-C)",
    )
    s.add_argument(
        "--max-peers",
        type=int,
        default=200,
        help="list at most this many peers, by index (0: every peer; a large swarm's take many pages)",
    )

    d = sub.add_parser("demo", help="a coordinator and peers on this machine, training the embedded default")
    d.add_argument("--peers", type=int, default=3, help="how many peers to start on this machine")
    d.add_argument("--rounds", type=int, default=10, help="finish the run after this many committed rounds")
    d.add_argument("--inner-steps", type=int, default=50, help="H: inner steps each peer trains per round")
    d.add_argument("--preset", default="tiny", help="model preset (tiny, small, medium, gpt2)")
    d.add_argument("--state-dir", help="keep the run's files here (default: a temporary directory)")
    d.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds")
    d.add_argument("--json", action="store_true", help="end with one JSON line summarising the run")

    e = sub.add_parser("export", help="a finished peer's final model as a Hugging Face directory or a safetensors file")
    e.add_argument("state_dir", help="the peer's --state-dir (it holds final/model.safetensors)")
    e.add_argument("out_dir", help="where to write it (created when missing)")
    e.add_argument(
        "--tokenizer",
        metavar="TOKENIZER_JSON",
        help="the tokenizer.json to export with the model (default: the run's [data] tokenizer, found as "
        "named or beside the state dir; none for a run on bytes or token files)",
    )
