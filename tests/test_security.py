"""No one outside a job can talk to its members or its coordinator (issue 16).

Tokens and their checks on their own; then real ExchangeServers refusing calls without
credentials, with another execution's, replayed or forged, over TCP and TLS; then a
hostile process (tests/hostile_peer.py) attacking every listening port of a running
job's driver and members on local[2], with TLS off and on, while the job must finish
with no restart and exactly-once output.
"""
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
from pyarrow import flight

from sparkjet import verify
from sparkjet.aligner import BarrierAligner
from sparkjet.connectors import ProcessorContext
from sparkjet.errors import InvalidArgumentError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.runtime import security as sec
from sparkjet.runtime.exchange import (
    ExchangeAuthError,
    ExchangeClient,
    ExchangeServer,
)
from sparkjet.runtime.security import LinkSecurity, ServerAuth, TLSIdentity
from sparkjet.sinks import TransactionalFileSink
from sparkjet.sources import GeneratorSource
from sparkjet.verify import last_update_per_key

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def tls():
    return TLSIdentity.self_signed()


# ------------------------------------------------------------------ tokens


def test_a_token_is_accepted_once_for_its_method_and_execution():
    s = LinkSecurity.generate(5)
    auth = ServerAuth(s)
    token = s.token("DO_ACTION")
    assert auth.check(token, "DO_ACTION") is None
    assert auth.check(token, "DO_ACTION") == "replayed"
    assert auth.check(s.token("DO_ACTION"), "LIST_ACTIONS") == "bad signature"
    assert auth.check(None, "DO_ACTION") == "missing"
    assert auth.check("", "DO_ACTION") == "missing"
    for bad in ("v1:5", "v2:5:" + "a" * 24 + ":1:" + "b" * 64, "v1:x:y:z:w", "garbage" * 20):
        assert auth.check(bad, "DO_ACTION") == "malformed", bad
    other = LinkSecurity.generate(6)
    assert auth.check(other.token("DO_ACTION"), "DO_ACTION") == "other execution"
    forged = LinkSecurity(5, b"x" * 32)  # the right id, another secret
    assert auth.check(forged.token("DO_ACTION"), "DO_ACTION") == "bad signature"
    old = int((time.time() - 2 * sec.TOKEN_WINDOW) * 1000)
    nonce = "ab" * 12
    stale = f"v1:5:{nonce}:{old}:{s._mac(5, nonce, old, 'DO_ACTION')}"
    assert auth.check(stale, "DO_ACTION") == "expired"


def test_credentials_never_show_their_secret_and_travel_pickled(tls):
    s = LinkSecurity.generate(3, tls)
    text = repr(s) + str(s) + repr(tls)
    assert s.secret.hex() not in text and str(s.secret) not in text
    assert b"PRIVATE" not in text.encode() and "redacted" in text
    back = pickle.loads(pickle.dumps(s))
    assert back.secret == s.secret and back.tls.certificate == tls.certificate
    assert ServerAuth(back).check(s.token("DO_GET"), "DO_GET") is None
    with pytest.raises(InvalidArgumentError, match="16 random bytes"):
        LinkSecurity(1, b"short")
    with pytest.raises(InvalidArgumentError, match="execution_id"):
        LinkSecurity(None, b"x" * 32)


def test_tls_settings_are_checked(tmp_path, tls):
    with pytest.raises(InvalidArgumentError, match="tls must be"):
        JobConfig(tls="yes", processing_guarantee="none")
    with pytest.raises(InvalidArgumentError, match="go together"):
        JobConfig(tls_certificate="c.pem", processing_guarantee="none")
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        TLSIdentity.from_files(str(tmp_path / "no.pem"), str(tmp_path / "no.key"))
    (tmp_path / "c.pem").write_bytes(tls.certificate)
    (tmp_path / "k.pem").write_bytes(tls.private_key)
    with pytest.raises(InvalidArgumentError, match="not a PEM certificate"):
        TLSIdentity.from_files(str(tmp_path / "k.pem"), str(tmp_path / "k.pem"))
    assert TLSIdentity.from_files(str(tmp_path / "c.pem"), str(tmp_path / "k.pem")) == tls


# ------------------------------------------------------------------ servers


def _servers(security):
    aligner = BarrierAligner(1, capacity=8)
    server = ExchangeServer(inbound={("aggregate", 0): aligner}, execution_id=security.execution_id,
                            security=security)
    server.on_action("poll", lambda body: {"commands": ["secret plans"]})
    return server, aligner


def _every_call(client: flight.FlightClient):
    """Every Flight method an outsider could try, each with a deadline."""
    o = flight.FlightCallOptions(timeout=5)
    body = json.dumps({"execution_id": 9, "body": {"member": 0}}).encode()
    command = json.dumps({"protocol": "sparkjet.exchange/1", "execution_id": 9,
                          "vertex": "aggregate", "processor": 0, "channel": 0}).encode()
    descriptor = flight.FlightDescriptor.for_command(command)
    return {
        "list_actions": lambda: list(client.list_actions(o)),
        "do_action": lambda: list(client.do_action(flight.Action("poll", body), o)),
        "list_flights": lambda: list(client.list_flights(options=o)),
        "get_flight_info": lambda: client.get_flight_info(descriptor, o),
        "do_get": lambda: client.do_get(flight.Ticket(b"x"), o).read_all(),
        "do_exchange": lambda: client.do_exchange(descriptor, o)[1].read_chunk(),
    }


@pytest.mark.parametrize("with_tls", [False, True], ids=["tcp", "tls"])
def test_calls_without_valid_credentials_are_refused_before_any_handler(with_tls, tls):
    security = LinkSecurity.generate(9, tls if with_tls else None)
    server, aligner = _servers(security)
    try:
        tls_options = {"tls_root_certs": tls.certificate, "override_hostname": "sparkjet"} \
            if with_tls else {}
        outsiders = {
            "no credentials": flight.FlightClient(server.location, **tls_options),
            "another execution's": flight.FlightClient(
                server.location, middleware=LinkSecurity.generate(8).client_middleware(),
                **tls_options),
            "a forged secret": flight.FlightClient(
                server.location, middleware=LinkSecurity(9, b"f" * 32).client_middleware(),
                **tls_options),
        }
        tried = 0
        for who, client in outsiders.items():
            for method, call in _every_call(client).items():
                with pytest.raises(flight.FlightUnauthenticatedError, match="call refused"):
                    call()
                    pytest.fail(f"{method} with {who} credentials was heard")
                tried += 1
        assert sum(server.refused.values()) == tried
        assert server.refused == {"missing": 6, "other execution": 6, "bad signature": 6}
        assert len(aligner) == 0  # nothing reached the keyed processor
        # The members' own client is heard.
        member = ExchangeClient(server.location, security=security)
        assert member.action("poll", {"member": 0}) == {"commands": ["secret plans"]}
        member.close()
    finally:
        server.close(timeout=2)


def test_an_action_must_name_its_execution(tmp_path):
    security = LinkSecurity.generate(4)
    server, _ = _servers(security)
    try:
        client = flight.FlightClient(server.location, middleware=security.client_middleware())
        o = flight.FlightCallOptions(timeout=5)
        for envelope in ({"execution_id": None, "body": {}}, {"body": {}},
                         {"execution_id": "4", "body": {}}):
            with pytest.raises(flight.FlightServerError, match="no execution id"):
                list(client.do_action(flight.Action("poll", json.dumps(envelope).encode()), o))
    finally:
        server.close(timeout=2)


def test_tls_links_refuse_plain_and_unpinned_clients(tls):
    security = LinkSecurity.generate(2, tls)
    server, _ = _servers(security)
    try:
        assert server.location.startswith("grpc+tls://")
        o = flight.FlightCallOptions(timeout=5)
        plain = "grpc+tcp://" + server.location.split("://")[1]
        with pytest.raises(flight.FlightUnavailableError):
            flight.FlightClient(plain, middleware=security.client_middleware()).list_actions(o)
        other = TLSIdentity.self_signed()  # trusts another certificate than the server's
        with pytest.raises(flight.FlightUnavailableError):
            flight.FlightClient(server.location, middleware=security.client_middleware(),
                                tls_root_certs=other.certificate,
                                override_hostname="sparkjet").list_actions(o)
        with pytest.raises(InvalidArgumentError, match="does not use grpc\\+tls"):
            ExchangeClient(plain, security=security)  # no downgrade
        client = ExchangeClient(server.location, security=security)
        assert client.ping() == {"execution_id": 2}
        client.close()
    finally:
        server.close(timeout=2)


def test_refusals_reach_the_client_as_auth_errors():
    server, _ = _servers(LinkSecurity.generate(1))
    try:
        client = ExchangeClient(server.location, security=LinkSecurity.generate(1))
        with pytest.raises(ExchangeAuthError, match="not authenticated") as info:
            client.ping(timeout=5)
        assert isinstance(info.value, PermissionError)
        with pytest.raises(ExchangeAuthError):
            client.channel("aggregate", 0, 0, execution_id=1)
        client.close()
    finally:
        server.close(timeout=2)


def test_snapshot_and_sink_directories_are_owner_only(tmp_path):
    from sparkjet.snapshot_store import SnapshotStore

    store = SnapshotStore(str(tmp_path / "snapshots"), 42)
    store.register_execution(1)
    store.close()
    modes = {p: p.stat().st_mode & 0o777 for p in (tmp_path / "snapshots").rglob("*")
             if p.is_dir()}
    assert modes and all(m == 0o700 for m in modes.values()), modes
    assert (tmp_path / "snapshots").stat().st_mode & 0o777 == 0o700
    writer = TransactionalFileSink(tmp_path / "out").open(
        ProcessorContext(42, 1, "sink", 0, 1, "exactly-once"))
    writer.write(pa.record_batch({"x": [1]}))
    writer.prepare(1)
    dirs = [tmp_path / "out", *(p for p in (tmp_path / "out").rglob("*") if p.is_dir())]
    assert all(d.stat().st_mode & 0o777 == 0o700 for d in dirs), dirs


# ------------------------------------------------------------------ a hostile peer


class _Recorder(flight.ClientMiddlewareFactory):
    """Records the headers a legitimate call sent: the "captured request" to replay."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.headers = None

    def start_call(self, info):
        middleware = self.inner.start_call(info)
        self.headers = middleware.sending_headers()
        return middleware


def _run_hostile(spark, tmp_path, with_tls: bool):
    source = GeneratorSource(total=2_500_000, partitions=4, keys=20_000, batch_size=20_000,
                             rate=150_000)
    pipeline = (Pipeline().read_from(source)
                .group_by("key").aggregate(count="count", sum=("sum", "value"))
                .write_to(TransactionalFileSink(tmp_path / "out")))
    config = JobConfig(name=f"hostile-{with_tls}", snapshot_store=str(tmp_path / "snapshots"),
                       snapshot_interval=0.5, local_parallelism=1, members=2,
                       max_restarts=0, tls=with_tls)
    job = Job(pipeline, config)
    started = threading.Event()
    events: list[dict] = []

    def progress(event):
        events.append(event)
        if event["event"] == "started":
            started.set()

    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(result=job.run(spark, on_progress=progress)),
                              daemon=True)
    runner.start()
    assert started.wait(120), "the job did not start"
    pids = [os.getpid(), *next(e for e in events if e["event"] == "started")["pids"].values()]
    # A request the coordinator really received, captured with its headers, for replay.
    coordinator = job._runner.current
    recorder = _Recorder(coordinator.security.client_middleware()[0])
    legit = flight.FlightClient(coordinator.location, middleware=[recorder],
                                **coordinator.security.client_options())
    body = json.dumps({"execution_id": coordinator.execution_id,
                       "body": {"member": 0, "error": "replayed by an outsider"}})
    list(legit.do_action(flight.Action("ping", body.encode())))
    captured = tmp_path / "captured.json"
    captured.write_text(json.dumps({"headers": recorder.headers, "action": "failed",
                                    "body": body}))
    report = tmp_path / "report.json"
    attacker = subprocess.run(
        [sys.executable, str(HERE / "hostile_peer.py"), "--pids", ",".join(map(str, pids)),
         "--report", str(report), "--captured", str(captured)],
        capture_output=True, text=True, timeout=300, check=False)
    assert attacker.returncode == 0, attacker.stderr[-3000:]
    runner.join(300)
    assert "result" in outcome, f"the job did not finish: {events[-3:]}"
    return outcome["result"], json.loads(report.read_text()), events, source


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.parametrize("with_tls", [False, True], ids=["tls-off", "tls-on"])
def test_a_hostile_peer_is_refused_everywhere(spark, tmp_path, with_tls):
    result, attempts, events, source = _run_hostile(spark, tmp_path, with_tls)
    assert [e["tls"] for e in events if e["event"] == "execution"] == [with_tls]
    accepted = [a for a in attempts if a["accepted"]]
    assert not accepted, accepted
    refused = [a for a in attempts if "call refused" in (a["error"] or "")]
    # The coordinator's and both members' servers answered with an authentication error.
    assert len({a["port"] for a in refused}) >= 3, attempts[:5]
    attacks = {a["attack"] for a in refused}
    for must in ("list_actions", "failed: null id", "ack: no id", "poll", "forged ack, id 1",
                 "replayed captured request", "data stream into a keyed processor"):
        assert must in attacks, (must, sorted(attacks))
    assert result.restarts == 0 and len(result.executions) == 1
    assert result.refused_calls >= len(refused)
    out = last_update_per_key(TransactionalFileSink.read(tmp_path / "out"))
    report = verify.check_aggregates(source.expected_counts(), out, key="key",
                                     columns=["count", "sum"], guarantee="exactly-once")
    assert report.valid and report.lost_count == 0 and report.duplicated_count == 0, str(report)
