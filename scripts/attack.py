#!/usr/bin/env python3
"""Attacks on a real swarm on loopback (a coordinator and peers started with the normal CLI), judged by what a
user sees: status, history, the final models. Each scenario starts its own runs:

    .venv/bin/python scripts/attack.py --rounds 8 --peers 3 --json                   # every scenario
    .venv/bin/python scripts/attack.py --scenario tie --rounds 8 --peers 3 --json    # one of them

    soak          honest peers and one Byzantine peer trained while an attacker tries every attack listed below
    tie           as many attacker identities as honest peers report one hash of theirs with a group of all of them:
                  the same support as the honest hash. A breach if it commits; the round must void as "a tie", and
                  once the attackers leave the honest result commits and the run finishes (scripts/attacks/tie.py)
    named_liar    a member reports, in every round, a hash of its own with a group naming every honest participant,
                  and never posts to their group: a breach if the run stalls or the lie commits
                  (scripts/attacks/named_liar.py)
    slice_owner   a peer running modified software (scripts/attacks/malicious_owner_peer.py: `swarm peer` with its
                  reduction replaced in-process) sets every average it computes to -100 x the honest one, in a run
                  with admits_strangers = true (a breach if the honest peers' models differ, or differ from the
                  simulator's untampered run) and in a butterfly run (the documented hole: reported, not a breach)
                  (scripts/attacks/slice_owner.py)

The soak's attacks, each tried every few seconds for the whole run:
    wrong_token          join with a token the run never issued
    revoked_token        join with a peer token the operator revoked (`swarm token revoke`)
    status_token         join with a read-only status token
    impersonation        Heartbeat / ReportRound / Leave for an honest peer's id, signed with another key
    fake_report          a member that joined properly but never trains: it claims to hold the committed
                         state and, the moment it is planned, reports the smallest hash 00... with a group of
                         only itself (it tries to be a quorum of one, and to win a tie broken by the hash)
    malformed            bytes that are not protobuf, and a 3 MiB peer name, to every method
    forged_dht_entry     a DHT node that never talked to the coordinator stores, through the coordinator's
                         node, group entries for honest peers with weight 1e30 and votes for hash ffff...
    byzantine_peer       (a real peer process, --faults scale@1:delta=-100: every Δ it sends is -100×)
    replayed_dht_entry   another DHT node with no token reads honest members' signed group entries and votes
                         of the open round and stores them again to outlive their newer ones (a later expiry),
                         asking each node it knows in turn: a breach if any node but the attacker's own two (the
                         forger's stores anything) takes one
    unplanned_votes      a second identity (a token of its own), in the rounds it is planned into with an even
                         number, reports 'ee...' with a group of itself and two identities of its own that
                         joined, signed their votes and left: the votes must count for nothing (a breach if ee...
                         commits)
    extreme_values       the same identity heartbeats every figure at the largest value a request may carry
                         (10**15 steps, samples and bytes, 1e10 seconds, a loss of 1.7e308) and reports them in
                         its odd rounds: a breach if any call, GetHistory and GetStatus included, answers INTERNAL
    share_grab           its heartbeats say its uplink is 1e10 Mbit/s; with --controller auto a breach if any
                         member's share of the vector is above 2/K (3/4 of two)
Two planned attacker identities against the honest peers and the Byzantine one: fewer than half of a round's
participants, which is what the commit rule's guarantee needs.
with ``[rounds] aggregation = "clipped_mean"``. A call the coordinator answers as it should is "refused";
one it accepts is a "breach". The fake report and the forged DHT entries are accepted on the wire by
design (the coordinator stores the report, the attacker's own node stores its entries); they count as
refused unless the fake hash gets committed or the swarm's state diverges. Then a calm run of the same length with honest peers only.

With --json the last stdout line is one JSON object: a scenario's result, or with every scenario {"scenarios":
{name: result}, "breaches": N, "ok": ...}. Each result has "breaches" (must be none) and "ok". The soak's: attacks
(per attack: tries, refused, breaches), breaches, rounds_committed, rounds_voided, divergent_commits (must be 0),
nonfinite_seen, coordinator_unanswered (status polls the coordinator did not answer), identical_final_models
(every peer's final model, bit for bit), final_eval_loss, calm_eval_loss, wall_s. Exit 0 only when every scenario
is ok: nothing breached, nothing diverged, the final models identical and finite, the run finished.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import grpc  # noqa: E402
from attacks.harness import tensors_digest  # noqa: E402
from attacks.identities import Identity  # noqa: E402
from chaos import final_eval, kill_tree, spawn  # noqa: E402

from swarm.app import token_admin  # noqa: E402
from swarm.app.status import status_to_dict  # noqa: E402
from swarm.control.client import CoordinatorClient, CoordinatorError, CoordinatorRejected  # noqa: E402
from swarm.control.joinstring import JoinString  # noqa: E402
from swarm.control.signing import CallSigner  # noqa: E402
from swarm.core.trust.credential import PeerKey  # noqa: E402
from swarm.net.link.libp2p_identity import Libp2pIdentity  # noqa: E402
from swarm.v1 import coordinator_pb2 as pb  # noqa: E402

FAKE_HASH = "0" * 16  # the smallest hash: it would win a tie broken by the hash
VOTES_HASH = "e" * 16
EXTREME_HASH = "d" * 16
ATTACKER_NAMES = {"liar", "sybil", "gone-0", "gone-1"}
ATTACK_HASHES = {FAKE_HASH: "fake_report", VOTES_HASH: "unplanned_votes", EXTREME_HASH: "extreme_values"}
MAX_COUNT, MAX_SECONDS, HUGE_LOSS = 10**15, 1e10, 1.7e308  # coordinator.api.limits: the largest valid values
EXTREME_METRICS = dict(
    loss=HUGE_LOSS,
    step_time_s=MAX_SECONDS,
    tokens_per_s=MAX_SECONDS,
    inner_time_s=MAX_SECONDS,
    wall_time_s=MAX_SECONDS,
    inner_steps=MAX_COUNT,
    tokens=MAX_COUNT,
    bytes_sent=MAX_COUNT,
    bytes_received=MAX_COUNT,
    upload_mbit_s=MAX_SECONDS,
    download_mbit_s=MAX_SECONDS,
    rtt_ms=MAX_SECONDS,
)
HONEST_REFUSALS = {
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ABORTED,
}


class Tally:
    def __init__(self) -> None:
        self.rows: dict[str, dict[str, int]] = defaultdict(lambda: {"tries": 0, "refused": 0, "breaches": 0})
        self.notes: list[str] = []

    def expect_refusal(self, attack: str, call: Callable[[], object]) -> None:
        """``call`` must be turned down with a proper status (never INTERNAL, never accepted)."""
        row = self.rows[attack]
        row["tries"] += 1
        try:
            call()
        except CoordinatorRejected as e:
            if e.code in HONEST_REFUSALS:
                row["refused"] += 1
                return
            self.breach(attack, f"answered {e.code.name}: {e.details}")
            return
        except grpc.RpcError as e:
            if e.code() in HONEST_REFUSALS:
                row["refused"] += 1
                return
            self.breach(attack, f"answered {e.code().name}: {e.details()}")
            return
        except CoordinatorError as e:  # unreachable: not a breach, but not a refusal either
            self.notes.append(f"{attack}: {e}")
            return
        self.breach(attack, "accepted")

    def breach(self, attack: str, why: str) -> None:
        self.rows[attack]["breaches"] += 1
        if len(self.notes) < 50:
            self.notes.append(f"BREACH {attack}: {why}")
        print(f"BREACH {attack}: {why}", file=sys.stderr, flush=True)


class Attacker:
    """Everything the attacker does, from one thread (hivemind's DHT forks: no gRPC call may be in flight)."""

    def __init__(self, join: JoinString, state_dir: Path, workdir: Path, tally: Tally) -> None:
        self.join, self.tally, self.workdir = join, tally, workdir
        self.status_join = JoinString.parse(token_admin.create(state_dir, role="status"))
        revoked = token_admin.create(state_dir, role="peer")
        token_admin.revoke(state_dir, revoked.split("token=")[1].split(".")[0])
        self.revoked_join = JoinString.parse(revoked)
        self.wrong_join = JoinString(
            host=join.host, port=join.port, token="default.not-the-secret", fingerprint=join.fingerprint
        )
        self.libp2p = Libp2pIdentity.create(workdir / "attacker-p2p.key")
        self.status_client = CoordinatorClient(self.status_join, request_timeout_s=5)
        self.liar = Identity(state_dir, workdir, "liar")
        self.liar_joined = self.liar.joined
        self.dht = None
        self.sybil = Identity(state_dir, workdir, "sybil")
        self.gone = [Identity(state_dir, workdir, f"gone-{i}") for i in range(2)]
        for identity in self.gone:  # joined (a credential to sign with), then left before any round they vote in
            identity.client.leave(identity.peer_id, "leaving")
        self.identities = [self.liar, self.sybil, *self.gone]
        self.names = ATTACKER_NAMES

    def start_stranger_dht(self) -> None:
        import hivemind

        self.dht = hivemind.DHT(
            start=True, initial_peers=list(self.liar_joined.dht_initial_peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"]
        )

    def round_of_attacks(self, status: dict) -> None:
        t = self.tally
        for name, join in (
            ("wrong_token", self.wrong_join),
            ("revoked_token", self.revoked_join),
            ("status_token", self.status_join),
        ):
            client = CoordinatorClient(join, request_timeout_s=5)
            t.expect_refusal(name, lambda: client.join(key=PeerKey.generate(), libp2p=self.libp2p, name=name))
            client.close()
        honest = [p for p in status["peers"] if p["state"] not in ("left", "evicted") and p["name"] not in self.names]
        if honest:
            self.impersonate(honest[0]["id"])
        self.reads()
        self.malformed()
        if self.dht is not None and honest:
            self.forge_dht_entries(status, [p["id"] for p in honest])
            self.replay_dht_entries(status)

    def impersonate(self, victim: str) -> None:
        client = CoordinatorClient(self.join, request_timeout_s=5)
        client.signer = CallSigner(PeerKey.generate(), 1)  # signs as someone, but not with the victim's key
        self.tally.expect_refusal("impersonation", lambda: client.heartbeat(victim, state=pb.PEER_STATE_READY))
        self.tally.expect_refusal(
            "impersonation", lambda: client.report_round(victim, 1, ok=True, state_hash=FAKE_HASH, group=[victim])
        )
        self.tally.expect_refusal("impersonation", lambda: client.leave(victim, "forged"))
        client.close()

    def every_poll(self, status: dict) -> None:
        """The attacks of planned identities, at each status poll: both heartbeat first (a lease runs out in seconds,
        and a round admits late peers only until its first report), then each reports the moment it is planned,
        before the honest peers' exchange."""
        run = status["run"]
        planned = {}
        for identity, metrics in ((self.liar, {}), (self.sybil, EXTREME_METRICS)):
            planned[identity.name] = self.attempt(identity.name, lambda: identity.planned_round(run, **metrics))
        if planned["liar"]:
            self.attempt("fake_report", lambda: self.lie(planned["liar"]))
        if planned["sybil"]:
            self.attempt("sybil", lambda: self.sybil_attacks(run, planned["sybil"]))

    def attempt(self, what: str, call: Callable[[], object]) -> object:
        try:
            return call()
        except CoordinatorRejected as e:
            if e.code not in HONEST_REFUSALS:
                self.tally.breach(what, f"answered {e.code.name}: {e.details}")
            elif len(self.tally.notes) < 50:
                self.tally.notes.append(f"{what}: {e.details}")
        except CoordinatorError as e:
            if len(self.tally.notes) < 50:
                self.tally.notes.append(f"{what}: {e}")
        return 0

    def lie(self, number: int) -> None:
        """Report the smallest hash with a group of just itself."""
        self.tally.rows["fake_report"]["tries"] += 1
        self.liar.client.report_round(
            self.liar.peer_id, number, ok=True, state_hash=FAKE_HASH, group=[self.liar.peer_id], samples=1
        )

    def sybil_attacks(self, run: dict, number: int) -> None:
        """In an even round, report with the signed votes of two identities that left before it (a group of three
        for ee...); in an odd one, every figure at its largest (its heartbeats carry them all along, its uplink
        too: share_grab)."""
        from swarm.net.exchange.group import signed_votes

        me = self.sybil.peer_id
        if number % 2 == 0:
            self.tally.rows["unplanned_votes"]["tries"] += 1
            group = [me, *(g.peer_id for g in self.gone)]
            votes = {i.peer_id: i.vote(run["run_id"], number, VOTES_HASH, group) for i in (self.sybil, *self.gone)}
            request = pb.ReportRoundRequest(
                peer_id=me, round=number, ok=True, state_hash=VOTES_HASH, group=group, samples=1
            )
            request.group_votes.extend(signed_votes(votes))
            self.sybil.client.report_round(request)
            return
        row = self.tally.rows["extreme_values"]
        row["tries"] += 1
        self.sybil.client.report_round(
            pb.ReportRoundRequest(
                peer_id=me,
                round=number,
                ok=True,
                state_hash=EXTREME_HASH,
                group=[me],
                samples=MAX_COUNT,
                inner_steps=MAX_COUNT,
                inner_time_s=MAX_SECONDS,
                exchange_time_s=MAX_SECONDS,
                bytes_sent=MAX_COUNT,
                bytes_received=MAX_COUNT,
                loss=HUGE_LOSS,
                param_count=MAX_COUNT,
                upload_mbit_s=MAX_SECONDS,
                download_mbit_s=MAX_SECONDS,
                rtt_ms=MAX_SECONDS,
            )
        )
        row["refused"] += 1  # taken, its figures cut to the round: the decision and the reads after it must stand

    def reads(self) -> None:
        """extreme_values, read side: what the run's watchers and peers read must still be answered."""
        row = self.tally.rows["extreme_values"]
        for read in (
            lambda: self.status_client.get_history(),
            lambda: self.status_client.get_status(),
            lambda: self.sybil.client.get_round(self.sybil.peer_id, 0),
        ):
            row["tries"] += 1
            try:
                read()
                row["refused"] += 1  # answered as it should: nothing to refuse, the coordinator stood
            except CoordinatorRejected as e:
                if e.code in HONEST_REFUSALS:
                    row["refused"] += 1
                else:
                    self.tally.breach("extreme_values", f"a read answered {e.code.name}: {e.details}")

    def malformed(self) -> None:
        from swarm.control import tls

        channel = tls.pinned_channel(self.join.host, self.join.port, self.join.fingerprint, timeout_s=5)
        try:
            for method in ("Join", "Heartbeat", "ReportRound", "Leave", "GetRound", "GetStatus", "Challenge"):
                call = channel.unary_unary(f"/swarm.v1.Coordinator/{method}")
                self.tally.expect_refusal("malformed", lambda: call(b"\xff\x00 not protobuf \x12\xff", timeout=5))
            client = CoordinatorClient(self.join, request_timeout_s=5)
            self.tally.expect_refusal(
                "malformed", lambda: client.join(key=PeerKey.generate(), libp2p=self.libp2p, name="x" * (3 << 20))
            )
            client.close()
        finally:
            channel.close()

    def forge_dht_entries(self, status: dict, victims: list[str]) -> None:
        from hivemind.utils.timed_storage import get_dht_time

        from swarm.net.exchange.rendezvous import group_key

        run = status["run"]
        for round_no in (run["open_round"], run["open_round"] + 1):
            if round_no <= 0:
                continue
            key = group_key(run["run_id"], round_no, 0)
            for victim in victims:
                forged = {
                    "peer_id": victim,
                    "dht_peer_id": str(self.dht.peer_id),
                    "index": 0,
                    "weight": 1e30,
                    "numel": 1,
                    "codec": "fp32",
                    "live_peers": 0,
                }
                self.tally.rows["forged_dht_entry"]["tries"] += 1
                self.dht.store(key, subkey=victim, value=forged, expiration_time=get_dht_time() + 60)
                vote = {"peer_id": victim, "dht_peer_id": str(self.dht.peer_id), "ok": True, "state_hash": FAKE_HASH}
                self.dht.store(f"{key}.votes", subkey=victim, value=vote, expiration_time=get_dht_time() + 60)

    def replay_dht_entries(self, status: dict) -> None:
        """From a node of its own (guarded like a member's, so it reads the members' entries, not the forgeries
        above; a validator needs only the run's id and public key), store the open round's signed entries again
        with a later expiry than their posters signed, at every node it knows but its own two: each must refuse.
        The forger's node is left out: it is the attacker's, unguarded, and stores anything."""
        import functools

        import hivemind
        from hivemind.utils.timed_storage import get_dht_time

        from swarm.net.dht_entries import EntryValidator
        from swarm.net.exchange.rendezvous import group_key

        if getattr(self, "replayer", None) is None:
            joined = self.liar_joined
            self.replayer = hivemind.DHT(
                start=True,
                initial_peers=list(joined.dht_initial_peers),
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                record_validators=[
                    EntryValidator(coordinator_public_key=joined.coordinator_public_key, run_id=joined.run_id)
                ],
            )
        if status["run"]["open_round"] <= 0:
            return
        own = [str(self.dht.peer_id)] if self.dht is not None else []
        key = group_key(status["run"]["run_id"], status["run"]["open_round"], 0)
        row = self.tally.rows["replayed_dht_entry"]
        for posted_under in (key, f"{key}.votes"):
            found = self.replayer.get(posted_under, latest=True)
            for subkey, item in found.value.items() if found is not None and isinstance(found.value, dict) else ():
                expiry = max(item.expiration_time, get_dht_time()) + 600
                answers = self.replayer.run_coroutine(
                    functools.partial(
                        store_at_each_node,
                        key=posted_under,
                        subkey=subkey,
                        value=item.value,
                        expiration_time=expiry,
                        skip=own,
                    )
                )
                took = sorted(node for node, stored in answers.items() if stored)
                if not any(stored is not None for stored in answers.values()):
                    if len(self.tally.notes) < 50:
                        self.tally.notes.append(f"replayed_dht_entry: no node answered a store of {posted_under}")
                    continue
                row["tries"] += 1
                if took:
                    self.tally.breach(
                        "replayed_dht_entry",
                        f"{len(took)} of {len(answers)} nodes ({', '.join(took)}) "
                        f"stored {subkey}'s entry of {posted_under} again with a "
                        "later expiry than it signed",
                    )
                else:
                    row["refused"] += 1

    def close(self) -> None:
        self.status_client.close()
        for identity in self.identities:
            identity.close()
        if self.dht is not None:
            self.dht.shutdown()
        if getattr(self, "replayer", None) is not None:
            self.replayer.shutdown()


async def store_at_each_node(
    _dht, node, *, key: str, subkey: str, value: object, expiration_time: float, skip: list[str]
) -> dict[str, Optional[bool]]:
    """In a DHT's process (``DHT.run_coroutine``): ask every node this one knows (the key's nearest included),
    but those in ``skip``, to store ``value`` under ``key`` and ``subkey`` until ``expiration_time``; each node's
    answer by its libp2p id (None: it did not answer). ``DHT.store`` answers only one node's, whichever came last."""
    import asyncio

    from hivemind.dht.routing import DHTID

    key_id = DHTID.generate(source=key)
    nearest = await node.find_nearest_nodes([key_id], k_nearest=node.num_replicas, exclude_self=True)
    peers = {
        **{p: None for p in node.protocol.routing_table.peer_id_to_uid},
        **{p: None for p in nearest[key_id].values()},
    }
    peers = [p for p in peers if str(p) not in skip]
    value_bytes = node.protocol.serializer.dumps(value)
    answers = await asyncio.gather(
        *(
            node.protocol.call_store(
                p, keys=[key_id], values=[value_bytes], expiration_time=[expiration_time], subkeys=[subkey]
            )
            for p in peers
        )
    )
    return {str(p): (answer[0] if answer else None) for p, answer in zip(peers, answers)}


class Run:
    def __init__(self, args: argparse.Namespace, workdir: Path, *, attacked: bool) -> None:
        self.args, self.workdir, self.attacked = args, workdir, attacked
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = workdir / "run.toml"
        self.config.write_text(
            f"[rounds]\ninner_steps = {args.inner_steps}\nmax_rounds = {args.rounds}\nmin_peers = {args.peers + 1}\n"
            'aggregation = "clipped_mean"\nmatchmaking_window_s = 5.0\nexchange_timeout_s = 10.0\n'
            "round_timeout_s = 90.0\n" + (f'controller = "{args.controller}"\n' if args.controller != "off" else "")
        )
        self.tally = Tally()
        self.committed: dict[int, str] = {}
        self.breached_rounds: set[int] = set()
        self.shares_seen: set = set()
        self.largest_share = 0.0
        self.divergent = self.nonfinite = self.unanswered = 0

    def start_coordinator(self) -> tuple[subprocess.Popen, JoinString]:
        proc = spawn(
            [
                "coordinator",
                "--config",
                str(self.config),
                "--state-dir",
                str(self.workdir / "coordinator"),
                "--lease-s",
                "6",
                "--exit-grace-s",
                "30",
            ],
            self.workdir / "coordinator.log",
            stdout=subprocess.PIPE,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline().decode()
            if line.startswith("join: "):
                return proc, JoinString.parse(line.split(" ", 1)[1].strip())
            if not line and proc.poll() is not None:
                break
        raise RuntimeError(f"the coordinator did not start; see {self.workdir / 'coordinator.log'}")

    def start_peer(self, join: JoinString, name: str, faults: str = "") -> subprocess.Popen:
        extra = ["--faults", faults] if faults else []
        return spawn(
            [
                "peer",
                "--join",
                str(join),
                "--state-dir",
                str(self.workdir / name),
                "--threads",
                "1",
                "--name",
                name,
                "--join-timeout-s",
                "300",
                *extra,
            ],
            self.workdir / f"{name}.log",
        )

    def check(self, status: dict) -> None:
        run = status["run"]
        if run["committed_hash"]:
            self.committed.setdefault(run["committed_round"], run["committed_hash"])
            attack = ATTACK_HASHES.get(run["committed_hash"])
            if attack is not None and run["committed_round"] not in self.breached_rounds:
                self.breached_rounds.add(run["committed_round"])
                self.tally.breach(attack, f"round {run['committed_round']} committed {run['committed_hash']}")
        self.check_shares(run)
        for peer in status["peers"]:
            if peer["state"] in ("left", "evicted") or peer["name"] in ATTACKER_NAMES:
                continue
            m = peer["metrics"]
            expected = self.committed.get(m["state_round"])
            if expected and m["state_hash"] and m["state_hash"] != expected:
                self.divergent += 1
                print(f"DIVERGENT: {peer['name']} holds {m['state_hash']}, committed {expected}", file=sys.stderr)
            if m["loss"] is not None and not math.isfinite(m["loss"]):
                self.nonfinite += 1

    def check_shares(self, run: dict) -> None:
        """share_grab: no member owns more than 2/K of the vector (3/4 of two), whatever uplink it claims."""
        choice = run.get("controller") or {}
        shares = choice.get("shares") or {}
        if not self.attacked or len(shares) < 2 or choice.get("round") in self.shares_seen:
            return
        self.shares_seen.add(choice.get("round"))
        row = self.tally.rows["share_grab"]
        row["tries"] += 1
        total, k = sum(shares.values()), len(shares)
        largest = max(shares.values()) / total
        if largest > min(2 / k, 0.75) + 1e-3:
            self.tally.breach(
                "share_grab",
                f"round {choice.get('round')}: a member owns {largest:.4f} of the vector in a group of {k}",
            )
        else:
            row["refused"] += 1
        self.largest_share = max(self.largest_share, largest)

    def run(self) -> dict:
        started = time.monotonic()
        coordinator, join = self.start_coordinator()
        state_dir = self.workdir / "coordinator"
        peers = {f"peer-{i}": self.start_peer(join, f"peer-{i}") for i in range(self.args.peers)}
        attacker: Optional[Attacker] = None
        if self.attacked:
            peers["byzantine"] = self.start_peer(join, "byzantine", faults="scale@1:delta=-100")
            attacker = Attacker(join, state_dir, self.workdir, self.tally)
            attacker.start_stranger_dht()
        else:
            peers["peer-extra"] = self.start_peer(join, "peer-extra")
        watcher = CoordinatorClient(attacker.status_join if attacker else join, request_timeout_s=5)
        status: Optional[dict] = None
        next_attack = time.monotonic()
        while time.monotonic() < started + self.args.timeout_s:
            try:
                status = status_to_dict(watcher.get_status())
            except CoordinatorError:
                self.unanswered += 1
                time.sleep(0.5)  # the coordinator did not answer within the client's timeout; ask again
                continue
            self.check(status)
            if status["run"]["finished"]:
                break
            if attacker is not None:
                attacker.every_poll(status)
            if attacker is not None and time.monotonic() >= next_attack:
                attacker.round_of_attacks(status)
                next_attack = time.monotonic() + self.args.attack_every_s
            if coordinator.poll() is not None:
                self.tally.breach("coordinator", f"the coordinator exited with status {coordinator.returncode}")
                break
            time.sleep(0.5)  # the soak's sampling period
        if attacker is not None:
            attacker.close()
        for proc in peers.values():
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                kill_tree(proc)
        watcher.close()
        kill_tree(coordinator)
        finals = {name: (self.workdir / name / "final" / "model.safetensors") for name in peers}
        digests = {name: tensors_digest(p) for name, p in finals.items() if p.exists()}
        run = (status or {"run": {}})["run"]
        return {
            "rounds_committed": run.get("rounds_committed", 0),
            "rounds_voided": run.get("rounds_voided", 0),
            "final_models": digests,
            "identical_final_models": len(digests) == len(peers) and len(set(digests.values())) == 1,
            "final_eval_loss": final_eval(self.workdir, peers),
            "wall_s": round(time.monotonic() - started, 1),
        }


SCENARIOS = ("soak", "tie", "named_liar", "slice_owner")


def soak(args: argparse.Namespace, base: Path) -> dict:
    """The soak scenario: the attacked run, then (unless --skip-calm) a calm one."""
    attacked = Run(args, base / "attacked", attacked=True)
    result = attacked.run()
    calm = {} if args.skip_calm else Run(args, base / "calm", attacked=False).run()
    # accepted on the wire; what counts is that they change nothing
    for indirect in ("fake_report", "forged_dht_entry", "unplanned_votes"):
        row = attacked.tally.rows[indirect]
        row["refused"] = row["tries"] - row["breaches"]
    breaches = sum(row["breaches"] for row in attacked.tally.rows.values())
    final = result["final_eval_loss"]
    return {
        "attacks": {name: dict(row) for name, row in sorted(attacked.tally.rows.items())},
        "breaches": breaches,
        "rounds_committed": result["rounds_committed"],
        "rounds_voided": result["rounds_voided"],
        "divergent_commits": attacked.divergent,
        "nonfinite_seen": attacked.nonfinite,
        "coordinator_unanswered": attacked.unanswered,
        "identical_final_models": result["identical_final_models"],
        "final_eval_loss": final,
        "calm_eval_loss": calm.get("final_eval_loss"),
        "largest_share": round(attacked.largest_share, 4),
        "calm_rounds_committed": calm.get("rounds_committed"),
        "calm_rounds_voided": calm.get("rounds_voided"),
        "wall_s": result["wall_s"],
        "notes": attacked.tally.notes[:20],
        "ok": (
            breaches == 0
            and attacked.divergent == 0
            and attacked.nonfinite == 0
            and result["identical_final_models"]
            and final is not None
            and math.isfinite(final)
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--scenario",
        choices=(*SCENARIOS, "all"),
        default="all",
        help="which scenario to run (default: all of them, one after the other)",
    )
    parser.add_argument("--peers", type=int, default=3, help="honest peers of each run")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--attack-every-s", type=float, default=3.0, help="soak: the period of the attacks' tries")
    parser.add_argument(
        "--timeout-s", type=float, default=1500, help="each run's limit: a run still going then stalled"
    )
    parser.add_argument("--skip-calm", action="store_true", help="soak: without the calm run")
    parser.add_argument(
        "--controller",
        choices=("off", "auto"),
        default="off",
        help="soak: [rounds] controller of both runs; share_grab needs auto (shares from uplinks)",
    )
    parser.add_argument("--tie-rounds", type=int, default=2, help="tie: rounds the attackers tie before they leave")
    parser.add_argument(
        "--liar-round-timeout-s",
        type=float,
        default=60.0,
        help="named_liar: [rounds] round_timeout_s (a round held for the liar would take this long)",
    )
    parser.add_argument("--workdir", help="keep logs here (default: a temporary directory)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    for name in ("peers", "rounds", "inner_steps", "tie_rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")

    base = Path(args.workdir or tempfile.mkdtemp(prefix="swarm-attack-"))
    chosen = SCENARIOS if args.scenario == "all" else (args.scenario,)
    results = {}
    for name in chosen:
        results[name] = (
            soak(args, base) if name == "soak" else importlib.import_module(f"attacks.{name}").run(args, base / name)
        )
        print(f"scenario {name}: {'ok' if results[name]['ok'] else 'NOT OK'}", file=sys.stderr, flush=True)
    if len(chosen) == 1:
        summary = results[chosen[0]]
    else:
        summary = {
            "scenarios": results,
            "breaches": sum(breach_count(r) for r in results.values()),
            "ok": all(r["ok"] for r in results.values()),
        }
    summary["workdir"] = str(base)
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=1), flush=True)
    return 0 if summary["ok"] else 1


def breach_count(result: dict) -> int:
    breaches = result["breaches"]
    return breaches if isinstance(breaches, int) else len(breaches)


if __name__ == "__main__":
    sys.exit(main())
