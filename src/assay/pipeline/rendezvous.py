"""An authenticated rendezvous for trainer ranks that meet over TCP (`train.rank_workers: ray`).

torch.distributed's TCPStore has no authentication: whoever reaches its port reads and writes its keys,
and gloo's rendezvous trusts them (each rank publishes its address there), so a process that reaches the
port could join the group as a rank, reading the gradients and weights and sending its own. Here rank 0
makes a random secret, which the other ranks receive through Ray (authenticated as the cluster is), and:

- the store listens on one address only (the loopback when every rank is on this machine), not on every
  interface as TCPStore's own server does;
- the group's keys live under a prefix derived from the secret, so a process without it finds none;
- before the group forms, every rank answers rank 0's fresh challenge with an HMAC under the secret, and
  rank 0 answers back; a wrong or premature answer stops the group from forming;
- once it has formed, every rank sends every other rank an HMAC under the secret over the group's own
  connections (an all-to-all: each pair, both ways), so a connection to a process that took a rank's
  place after the rendezvous is found before the group carries any data.

What it does not do: encrypt, or protect against a host on the path that reads and rewrites the traffic
(the store's messages and gloo's data travel in the clear); a process that reaches the port can still
hold connections open or write keys of its own (a denial of service, not a rank)."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from assay.core.errors import AssayError
from assay.train.sharding import leave_process_group

SECRET_BYTES = 32
_TAG_BYTES = hashlib.sha256().digest_size


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet and the secret they prove they hold; handed to ranks 1 .. N-1 as an actor
    argument. `loopback`: every rank is on this machine, so gloo listens on the loopback too."""

    host: str
    port: int
    secret: bytes = field(repr=False)
    loopback: bool


def tag(secret: bytes, *parts: str | int | bytes) -> bytes:
    """HMAC-SHA256 under the secret of the parts, each length-prefixed so that no two lists of parts
    give the same message."""
    msg = b"".join(len(b).to_bytes(4, "big") + b for b in
                   (p if isinstance(p, bytes) else str(p).encode() for p in parts))
    return hmac.new(secret, msg, hashlib.sha256).digest()


def open_rendezvous(host: str, timeout: datetime.timedelta) -> tuple[Rendezvous, dist.TCPStore]:
    """Rank 0: a fresh secret and the store's server, listening on `host` alone (the socket is bound
    here and handed over, since TCPStore would bind every interface) on a free port. Keep the store
    until the group is destroyed."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.bind((host, 0))
        sock.listen()
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # the store's server owns the listening socket from here
    try:
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout,
                              master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise
    return Rendezvous(host, port, secrets.token_bytes(SECRET_BYTES), host in ("127.0.0.1", "::1")), store


def group_store(store: dist.Store, secret: bytes) -> dist.PrefixStore:
    """The group's view of the store: its keys under a prefix derived from the secret (not the secret:
    keys cross the network in the clear)."""
    return dist.PrefixStore(f"assay/{tag(secret, 'prefix').hex()}/", store)


def admit(store: dist.Store, secret: bytes, world: int) -> bytes:
    """Rank 0, before the group forms: post a fresh challenge, check every rank's answer, and answer back
    (so that a rank knows rank 0 holds the secret too). Returns the challenge."""
    challenge = secrets.token_bytes(SECRET_BYTES)
    store.set("challenge", challenge)
    for rank in range(1, world):
        if not hmac.compare_digest(store.get(f"proof/{rank}"), tag(secret, "rank", challenge, rank)):
            store.set("verdict", b"refused")
            raise AssayError(f"trainer rank {rank} answered the rendezvous' challenge without its secret: a "
                             "process that does not hold it tried to join the group as that rank; the group was not "
                             "formed. Keep the trainer's node unreachable to others (a firewall), and rerun")
    store.set("verdict", tag(secret, "admitted", challenge))
    return challenge


def prove(store: dist.Store, secret: bytes, rank: int) -> bytes:
    """Rank 1 .. N-1, before the group forms: answer rank 0's challenge, and check its answer. The first
    answer for a rank is the one kept, so a rank that finds another there stops. Returns the challenge."""
    challenge = store.get("challenge")
    mine = tag(secret, "rank", challenge, rank)
    if store.compare_set(f"proof/{rank}", "", mine) != mine:
        raise AssayError(f"another process answered the rendezvous' challenge as trainer rank {rank} first; the "
                         "group was not formed. Keep the trainer's node unreachable to others (a firewall), and rerun")
    if not hmac.compare_digest(store.get("verdict"), tag(secret, "admitted", challenge)):
        raise AssayError(f"rank 0 refused the group at the rendezvous (see its error); trainer rank {rank} stops")
    return challenge


def check_connections(secret: bytes, challenge: bytes) -> None:
    """Every rank, once the group has formed: send every other rank a tag of (challenge, sender, receiver)
    over the group's connections and check the one each sent here."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = torch.frombuffer(bytearray(b"".join(tag(secret, "pair", challenge, rank, to) for to in range(world))),
                           dtype=torch.uint8)
    got = torch.empty_like(out)
    dist.all_to_all_single(got, out)
    for sender in range(world):
        received = got[sender * _TAG_BYTES:(sender + 1) * _TAG_BYTES].numpy().tobytes()
        if not hmac.compare_digest(received, tag(secret, "pair", challenge, sender, rank)):
            raise AssayError(f"trainer rank {rank}'s connection from rank {sender} did not prove the rendezvous' "
                             "secret: a process that does not hold it sits in the group's connections; the group is "
                             "left unused. Keep the trainer's node unreachable to others (a firewall), and rerun")


def loopback_interface() -> str | None:
    """The loopback's interface name (Linux `lo`, BSD and macOS `lo0`), or None where neither exists."""
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), None)


def pin_gloo_to_loopback() -> Callable[[], None]:
    """Make gloo listen on the loopback (it reads GLOO_SOCKET_IFNAME whenever it builds a group; by default
    it listens on the address the host name resolves to). A value the user set is kept. Returns what
    undoes it."""
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    if before is not None or (lo := loopback_interface()) is None:
        return lambda: None
    os.environ["GLOO_SOCKET_IFNAME"] = lo
    return lambda: os.environ.pop("GLOO_SOCKET_IFNAME", None)


def join(rv: Rendezvous, rank: int, world: int, timeout: datetime.timedelta,
         server: dist.TCPStore | None = None) -> None:
    """Form the gloo group through the rendezvous: rank 0 passes the store `open_rendezvous` gave it, the
    others connect to it. Raises AssayError, with no group left, when a peer does not prove the secret."""
    store = server if server is not None else dist.TCPStore(rv.host, rv.port, is_master=False, timeout=timeout)
    keys = group_store(store, rv.secret)
    challenge = admit(keys, rv.secret, world) if rank == 0 else prove(keys, rv.secret, rank)
    dist.init_process_group("gloo", store=keys, rank=rank, world_size=world, timeout=timeout)
    try:
        check_connections(rv.secret, challenge)
    except BaseException:
        leave_process_group()
        raise
