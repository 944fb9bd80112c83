"""The one place hivemind's API is named: every module of swarm/ that uses hivemind imports it from here, so that
a hivemind upgrade (a moved module, a renamed class, a changed signature) touches this file only.

What Swarm uses of hivemind: its DHT (a node in a process of its own, the records it stores and the validators
that guard them, its clock, its keys' ids and serializer) and its libp2p daemon client (``P2P``: streams, unary
and streaming handlers, peer ids). The averaging, compression and optimizer parts of hivemind are not used.

Importing this module imports hivemind, which is slow (seconds of CPU) and must happen before the DHT process
forks (``swarm.net.bulk.transport``). A module that must stay importable without hivemind (the transport, which
a peer imports before it starts its DHT) imports this one inside the function that needs it, or under
``TYPE_CHECKING`` for its annotations. ``swarm.net`` runs first and keeps hivemind's own import of
``scipy.optimize`` deferred (``swarm.net.deferred_imports``).
"""

from __future__ import annotations

from hivemind import DHT
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.utils.asyncio import as_aiter
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

__all__ = [
    "DHT",  # the DHT node (runs in a forked process); ``store``/``get``/``run_coroutine``/``replicate_p2p``
    "DHTID",  # a DHT key's id (the key hashed, as validators see it)
    "DHTRecord",  # a record as a validator sees it
    "RecordValidatorBase",  # a validator of stored records (``swarm.net.dht_entries.EntryValidator``)
    "MSGPackSerializer",  # the DHT's value serializer
    "get_dht_time",  # the DHT's clock: expirations are in it
    "P2P",  # the libp2p daemon client: streams, handlers, ``peer_id``
    "P2PContext",  # what a handler is called with (the remote peer)
    "PeerID",  # a libp2p peer id
    "StreamInfo",  # a raw stream's remote end (the relay)
    "as_aiter",  # a list as an async iterator (a streaming call's requests)
]
