"""The Ray ranks' rendezvous (pipeline/rendezvous.py), on the loopback: the store listens there alone, a
process without the secret cannot join the group or pass as a rank, and the real ranks form it."""

import datetime
import secrets
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from assay.core.errors import AssayError
from assay.pipeline.rendezvous import Rendezvous, check_connections, group_store, join, open_rendezvous, prove, tag
from assay.train.sharding import leave_process_group

TIMEOUT = datetime.timedelta(seconds=60)  # a bound for a hang, not a timing under test
INTRUDER_WAIT = datetime.timedelta(seconds=5)  # how long the intruder waits for a group that never answers it


def _real_rank(rv: Rendezvous, results) -> None:
    torch.set_num_threads(1)
    try:
        join(rv, 1, 2, TIMEOUT)
        t = torch.tensor([1.0])
        dist.all_reduce(t)
        results.put(("rank 1", float(t)))
        leave_process_group()
    except BaseException as e:
        results.put(("rank 1", repr(e)))


def _intruder(host: str, port: int, results) -> None:
    """What could join the ranks' group before: torch's own rendezvous at the address, claiming rank 1."""
    results.put(("intruder", "started"))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=1, world_size=2,
                                timeout=INTRUDER_WAIT)
        results.put(("intruder", "joined"))
        leave_process_group()
    except BaseException as e:
        results.put(("intruder", f"refused: {e.__class__.__name__}"))


def _listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net lists them) of the sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if Path(table).exists():
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


def test_a_process_without_the_secret_cannot_join_and_the_ranks_form_the_group():
    rv, server = open_rendezvous("127.0.0.1", TIMEOUT)
    if Path("/proc/net/tcp").exists():  # Linux: TCPStore's own server would listen on every interface
        assert _listening_addresses(rv.port) == {"0100007F"}  # 127.0.0.1 alone
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    intruder = ctx.Process(target=_intruder, args=(rv.host, rv.port, results))
    intruder.start()
    assert results.get(timeout=120) == ("intruder", "started")  # it reaches the port before rank 1 starts
    rank1 = ctx.Process(target=_real_rank, args=(rv, results))
    rank1.start()
    try:
        join(rv, 0, 2, TIMEOUT, server=server)
        t = torch.tensor([2.0])
        dist.all_reduce(t)
        assert float(t) == 3.0  # the group is rank 0 and the real rank 1
        got = dict(results.get(timeout=120) for _ in range(2))
        assert got["rank 1"] == 3.0
        assert got["intruder"].startswith("refused")  # it never was rank 1
    finally:
        leave_process_group()
        for p in (intruder, rank1):
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def test_an_answer_without_the_secret_stops_the_group_before_it_forms():
    """A process that saw the group's key prefix on the wire, but holds no secret, answers rank 1's
    challenge first: rank 0 refuses, and the real rank 1, finding the answer taken, stops too."""
    rv, server = open_rendezvous("127.0.0.1", TIMEOUT)
    prefix_only = group_store(dist.TCPStore(rv.host, rv.port, is_master=False, timeout=TIMEOUT), rv.secret)
    challenge = {}

    def intrude() -> None:
        challenge["seen"] = prefix_only.get("challenge")  # waits for rank 0 to post it
        prefix_only.set("proof/1", tag(secrets.token_bytes(32), "rank", challenge["seen"], 1))

    intruder = threading.Thread(target=intrude)
    intruder.start()
    with pytest.raises(AssayError, match="trainer rank 1 answered the rendezvous' challenge without its secret"):
        join(rv, 0, 2, TIMEOUT, server=server)
    intruder.join()
    assert not dist.is_initialized()
    real = group_store(dist.TCPStore(rv.host, rv.port, is_master=False, timeout=TIMEOUT), rv.secret)
    with pytest.raises(AssayError, match="another process answered the rendezvous' challenge as trainer rank 1"):
        prove(real, rv.secret, 1)
    del server


def _plain_rank(store: str, secret: bytes, challenge: bytes, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=1, world_size=2)
    try:
        check_connections(secret, challenge)
        results.put("passed")
    except AssayError as e:
        results.put(str(e))
    finally:
        leave_process_group()


def test_a_rank_in_the_group_without_the_secret_is_found_on_its_connections(tmp_path):
    """A group formed some other way, with rank 1 holding another secret: each side finds the other's
    tag wrong over their connection."""
    challenge = secrets.token_bytes(32)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    other = ctx.Process(target=_plain_rank, args=(str(tmp_path / "store"), secrets.token_bytes(32), challenge, results))
    other.start()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=2)
    try:
        with pytest.raises(AssayError, match="trainer rank 0's connection from rank 1 did not prove"):
            check_connections(secrets.token_bytes(32), challenge)
        assert "trainer rank 1's connection from rank 0 did not prove" in results.get(timeout=120)
    finally:
        leave_process_group()
        other.join(timeout=60)
        if other.is_alive():
            other.kill()
