"""No one outside a job can talk to its members or its coordinator (issue 16).

Tokens and their checks on their own; then real ExchangeServers refusing calls without
credentials, with another execution's, replayed or forged, over TCP and TLS; then a
hostile process (tests/helpers/hostile_peer.py) attacking every listening port of a running
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
from sparkjet.connectors.base import ProcessorContext
from sparkjet.errors import InvalidArgumentError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.runtime.aligner import BarrierAligner
from sparkjet.runtime.exchange import (
    ExchangeAuthError,
    ExchangeClient,
    ExchangeServer,
)
from sparkjet.runtime.exchange import security as sec
from sparkjet.runtime.exchange.security import LinkSecurity, ServerAuth, TLSIdentity
from sparkjet.sinks import TransactionalFileSink
from sparkjet.sources import GeneratorSource
from sparkjet.verify import last_update_per_key

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


@pytest.fixture(scope="module")
def tls():
    return TLSIdentity.self_signed()


# ------------------------------------------------------------------ tokens


HERE_SERVER = "grpc+tcp://127.0.0.1:1"


def test_a_token_is_accepted_once_for_its_method_server_and_execution():
    s = LinkSecurity.generate(5)
    auth = ServerAuth(s, HERE_SERVER)

    def check(token, method="DO_ACTION"):
        return auth.check(token, method)[0]

    token = s.token("DO_ACTION", HERE_SERVER)
    assert check(token) is None
    assert check(token) == "replayed"
    assert check(s.token("DO_ACTION", HERE_SERVER), "LIST_ACTIONS") == "bad signature"
    assert check(s.token("DO_ACTION", "grpc+tcp://127.0.0.1:2")) == "bad signature"
    assert check(None) == "missing" and check("") == "missing"
    for bad in ("v1:5", "v2:5:" + "a" * 24 + ":1:-:" + "b" * 64, "v1:x:y:z:-:w", "garbage" * 20,
                "v1:" + "9" * 5000 + ":" + "a" * 24 + ":1:-:" + "b" * 64,  # int() would raise
                "v1:5:" + "a" * 24 + ":" + "9" * 400 + ":-:" + "b" * 64,  # overflow
                "v1:٥:" + "a" * 24 + ":1:-:" + "b" * 64):  # a non-ASCII digit
        assert check(bad) == "malformed", bad
    # Another execution's token, and a forgery with the right id, fail alike: a refusal
    # tells nothing about which execution runs.
    assert check(LinkSecurity.generate(6).token("DO_ACTION", HERE_SERVER)) == "bad signature"
    assert check(LinkSecurity(5, b"x" * 32).token("DO_ACTION", HERE_SERVER)) == "bad signature"
    for skew in (-2, 2):  # too old, or from too far in the future
        millis = str(int((time.time() + skew * sec.TOKEN_WINDOW) * 1000))
        nonce = "ab" * 12
        token = f"v1:5:{nonce}:{millis}:-:{s._mac('5', nonce, millis, '-', 'DO_ACTION', HERE_SERVER)}"
        assert check(token) == "expired"
    # A body digest is part of what is signed.
    digest = sec.action_digest("poll", b"{}")
    signed = s.token("DO_ACTION", HERE_SERVER, digest)
    assert auth.check(signed, "DO_ACTION") == (None, digest)
    tampered = signed.replace(digest, sec.action_digest("failed", b"{}"))
    assert check(tampered) == "bad signature"


def test_credentials_never_show_their_secret_and_travel_pickled(tls):
    s = LinkSecurity.generate(3, tls)
    text = repr(s) + str(s) + repr(tls)
    assert s.secret.hex() not in text and str(s.secret) not in text
    assert b"PRIVATE" not in text.encode() and "redacted" in text
    back = pickle.loads(pickle.dumps(s))
    assert back.secret == s.secret and back.tls.certificate == tls.certificate
    assert ServerAuth(back, HERE_SERVER).check(s.token("DO_GET", HERE_SERVER), "DO_GET")[0] is None
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


def _every_call(client: flight.FlightClient, credentials: LinkSecurity | None, location: str):
    """Every Flight method an outsider could try, each with a deadline and, if given,
    tokens signed with ``credentials``."""

    def o(method="DO_ACTION", **kw):
        if credentials is None:
            return flight.FlightCallOptions(timeout=5)
        return credentials.call_options(method, location, timeout=5, **kw)

    body = json.dumps({"execution_id": 9, "body": {"member": 0}}).encode()
    command = json.dumps({"protocol": "sparkjet.exchange/1", "execution_id": 9,
                          "vertex": "aggregate", "processor": 0, "channel": 0}).encode()
    descriptor = flight.FlightDescriptor.for_command(command)
    return {
        "list_actions": lambda: list(client.list_actions(o("LIST_ACTIONS"))),
        "do_action": lambda: list(client.do_action(flight.Action("poll", body),
                                                   o("DO_ACTION", action="poll", body=body))),
        "list_flights": lambda: list(client.list_flights(options=o("LIST_FLIGHTS"))),
        "get_flight_info": lambda: client.get_flight_info(descriptor, o("GET_FLIGHT_INFO")),
        "do_get": lambda: client.do_get(flight.Ticket(b"x"), o("DO_GET")).read_all(),
        "do_exchange": lambda: client.do_exchange(descriptor, o("DO_EXCHANGE"))[1].read_chunk(),
    }


@pytest.mark.parametrize("with_tls", [False, True], ids=["tcp", "tls"])
def test_calls_without_valid_credentials_are_refused_before_any_handler(with_tls, tls):
    security = LinkSecurity.generate(9, tls if with_tls else None)
    server, aligner = _servers(security)
    try:
        tls_options = {"tls_root_certs": tls.certificate, "override_hostname": "sparkjet"} \
            if with_tls else {}
        client = flight.FlightClient(server.location, **tls_options)
        outsiders = {"no credentials": None, "another execution's": LinkSecurity.generate(8),
                     "a forged secret": LinkSecurity(9, b"f" * 32)}
        tried = 0
        for who, credentials in outsiders.items():
            for method, call in _every_call(client, credentials, server.location).items():
                with pytest.raises(flight.FlightUnauthenticatedError) as info:
                    call()
                    pytest.fail(f"{method} with {who} credentials was heard")
                # The same words whatever the reason: nothing to learn from a refusal.
                assert "call refused (unauthenticated)" in str(info.value), info.value
                tried += 1
        assert server.refused == {"missing": 6, "bad signature": 12}
        # A genuine token for another server of the same execution is refused here too.
        elsewhere = security.call_options("LIST_ACTIONS", "grpc+tcp://127.0.0.1:1", timeout=5)
        with pytest.raises(flight.FlightUnauthenticatedError):
            list(client.list_actions(elsewhere))
        # A genuine token for one action does not carry another body.
        body = json.dumps({"execution_id": 9, "body": {"member": 0}}).encode()
        options = security.call_options("DO_ACTION", server.location, timeout=5,
                                        action="poll", body=b"{}")
        with pytest.raises(flight.FlightUnauthenticatedError):
            list(client.do_action(flight.Action("poll", body), options))
        assert server.refused == {"missing": 6, "bad signature": 13, "body mismatch": 1}
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
        client = flight.FlightClient(server.location)
        for envelope in ({"execution_id": None, "body": {}}, {"body": {}},
                         {"execution_id": "4", "body": {}}):
            body = json.dumps(envelope).encode()
            options = security.call_options("DO_ACTION", server.location, timeout=5,
                                            action="poll", body=body)
            with pytest.raises(flight.FlightServerError, match="no execution id"):
                list(client.do_action(flight.Action("poll", body), options))
    finally:
        server.close(timeout=2)


def test_tls_links_refuse_plain_and_unpinned_clients(tls):
    security = LinkSecurity.generate(2, tls)
    server, _ = _servers(security)
    try:
        assert server.location.startswith("grpc+tls://")
        o = security.call_options("LIST_ACTIONS", server.location, timeout=5)
        plain = "grpc+tcp://" + server.location.split("://")[1]
        with pytest.raises(flight.FlightUnavailableError):
            flight.FlightClient(plain).list_actions(o)
        other = TLSIdentity.self_signed()  # trusts another certificate than the server's
        with pytest.raises(flight.FlightUnavailableError):
            flight.FlightClient(server.location, tls_root_certs=other.certificate,
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
    from sparkjet.snapshot.store import SnapshotStore

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


def _held_until(flag: str, seconds: float):
    """A map that holds each batch ``seconds`` until the file ``flag`` exists."""
    def hold(batch):
        if not os.path.exists(flag):
            time.sleep(seconds)
        return batch
    return hold


def _run_hostile(spark, tmp_path, with_tls: bool):
    # The job must outlive the attack, however long the attack takes on a loaded machine:
    # until the attacker is done each batch waits 0.5 s (2 x 20,000 events every 0.5 s: the
    # 2.5 M would last 31 s), then the job runs to its end at full speed. (A source at a
    # fixed rate made the job last 17 s whatever the attack's length, and under load the
    # job once outlived the attacker by only 2 s.)
    attacked = tmp_path / "attacked"
    source = GeneratorSource(total=2_500_000, partitions=4, keys=20_000, batch_size=20_000)
    pipeline = (Pipeline().read_from(source).map_batches(_held_until(str(attacked), 0.5))
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
    body = json.dumps({"execution_id": coordinator.execution_id, "body": {}})
    options = coordinator.security.call_options("DO_ACTION", coordinator.location, timeout=10,
                                                action="ping", body=body.encode())
    legit = flight.FlightClient(coordinator.location, **coordinator.security.client_options())
    assert list(legit.do_action(flight.Action("ping", body.encode()), options))
    legit.close()
    (header, token), = options.headers
    captured = tmp_path / "captured.json"
    captured.write_text(json.dumps({"headers": {header.decode(): token.decode()},
                                    "action": "ping", "body": body}))
    secret = coordinator.security.secret.hex()
    report = tmp_path / "report.json"
    attacker = subprocess.run(
        [sys.executable, str(HELPERS / "hostile_peer.py"), "--pids", ",".join(map(str, pids)),
         "--report", str(report), "--captured", str(captured)],
        capture_output=True, text=True, timeout=300, check=False)
    attacked.touch()
    assert attacker.returncode == 0, attacker.stderr[-3000:]
    runner.join(300)
    assert "result" in outcome, f"the job did not finish: {events[-3:]}"
    assert secret not in json.dumps(events), "a progress event holds the secret"
    return outcome["result"], json.loads(report.read_text()), events, source


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.parametrize("with_tls", [False, True], ids=["tls-off", "tls-on"])
def test_a_hostile_peer_is_refused_everywhere(spark, tmp_path, with_tls):
    result, attempts, events, source = _run_hostile(spark, tmp_path, with_tls)
    assert [e["tls"] for e in events if e["event"] == "execution"] == [with_tls]
    accepted = [a for a in attempts if a["accepted"]]
    assert not accepted, accepted
    flight_ports = {(a["port"], a["scheme"]) for a in attempts if a["attack"] != "probe"}
    # The coordinator's and both members' servers, each in the job's one scheme.
    assert len(flight_ports) == 3, flight_ports
    assert {scheme for _, scheme in flight_ports} == {"grpc+tls" if with_tls else "grpc+tcp"}
    attacks = [a for a in attempts if a["attack"] != "probe"]
    # Every attempt on every Flight port was stopped by the authentication, before any
    # handler: not one got as far as an application error.
    stopped_elsewhere = [a for a in attacks if "call refused (unauthenticated)" not in a["error"]]
    assert not stopped_elsewhere, stopped_elsewhere[:3]
    names = {a["attack"] for a in attacks}
    for must in ("list_actions", "failed: null id", "ack: no id", "poll", "forged ack, id 1",
                 "replayed captured request", "data stream into a keyed processor"):
        assert must in names, (must, sorted(names))
    refused = attacks
    assert result.restarts == 0 and len(result.executions) == 1
    assert result.refused_calls >= len(refused)
    out = last_update_per_key(TransactionalFileSink.read(tmp_path / "out"))
    report = verify.check_aggregates(source.expected_counts(), out, key="key",
                                     columns=["count", "sum"], guarantee="exactly-once")
    assert report.valid and report.lost_count == 0 and report.duplicated_count == 0, str(report)


def _issued(ca_key, ca_name, name: str, days: int = 30):
    """A leaf certificate for DNS ``name`` signed by the CA, and its key (PEM)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def test_a_user_certificate_chain_pins_its_leaf_only(tmp_path):
    """With a fullchain file, only the leaf is trusted: another certificate from the same
    CA, for the same name, is refused; a key of another certificate, a certificate for
    another name or an expired one are refused when the job is configured."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(1)
          .not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=30))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    leaf, leaf_key = _issued(ca_key, ca_name, "jobs.example")
    (tmp_path / "fullchain.pem").write_bytes(leaf + ca)
    (tmp_path / "key.pem").write_bytes(leaf_key)
    mine = TLSIdentity.from_files(str(tmp_path / "fullchain.pem"), str(tmp_path / "key.pem"),
                                  "jobs.example")
    assert mine.certificate == leaf  # the CA is not kept, so not trusted
    impostor_cert, impostor_key = _issued(ca_key, ca_name, "jobs.example")
    impostor = LinkSecurity.generate(3, TLSIdentity(impostor_cert, impostor_key,
                                                    "jobs.example"))
    genuine = LinkSecurity.generate(3, mine)
    for server_security, heard in ((genuine, True), (impostor, False)):
        server, _ = _servers(server_security)
        try:
            client = ExchangeClient(server.location, security=genuine)
            if heard:
                assert client.ping(timeout=5) == {"execution_id": 3}
            else:
                with pytest.raises(Exception, match="unreachable|connection failed"):
                    client.ping(timeout=5)
            client.close()
        finally:
            server.close(timeout=2)
    (tmp_path / "other.key").write_bytes(impostor_key)
    with pytest.raises(InvalidArgumentError, match="not the certificate's"):
        TLSIdentity.from_files(str(tmp_path / "fullchain.pem"), str(tmp_path / "other.key"),
                               "jobs.example")
    with pytest.raises(InvalidArgumentError, match="not the server name 'sparkjet'"):
        TLSIdentity.from_files(str(tmp_path / "fullchain.pem"), str(tmp_path / "key.pem"))
    old, old_key = _issued(ca_key, ca_name, "jobs.example", days=-1)
    (tmp_path / "old.pem").write_bytes(old)
    (tmp_path / "old.key").write_bytes(old_key)
    with pytest.raises(InvalidArgumentError, match="not now"):
        TLSIdentity.from_files(str(tmp_path / "old.pem"), str(tmp_path / "old.key"),
                               "jobs.example")


def test_a_directory_of_another_user_is_refused(tmp_path):
    from sparkjet.snapshot.store import SnapshotStore

    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, 4321, 4321)  # made first by someone else, in a shared place
    with pytest.raises(InvalidArgumentError, match="belongs to user 4321"):
        store = SnapshotStore(str(theirs), 42)
        store.register_execution(1)
