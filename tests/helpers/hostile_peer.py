"""An outsider on the same machine as a running job: finds every port its driver and member
processes listen on, and tries on each what issue 16 lists (list_actions, every action with
no id, a null id and guessed ids, a forged ack, a poll, a replayed captured request, and a
data stream into a keyed processor), over plain TCP and over TLS (accepting any
certificate, so that what answers is the authentication, not the handshake).

    python tests/helpers/hostile_peer.py --pids 123,456 --report out.json [--captured FILE]

Writes a JSON list of attempts {port, scheme, attack, accepted, error}; an attempt is
accepted only if the server ran it and answered. Exit code 0 whatever the outcome: the
test reads the report. Only 127.0.0.1 is ever a target; every call has a deadline.
"""
import argparse
import json
import time

import psutil
import pyarrow as pa
from pyarrow import flight

ACTIONS = ("ack", "done", "failed", "ping", "poll")
LOOPBACK = ("127.0.0.1", "::ffff:127.0.0.1", "0.0.0.0", "::")
GUESSED_IDS = (0, 1, 2, 3, int(time.time() * 1000) & (2**62 - 1))


def listening_ports(pids: list[int]) -> list[int]:
    ports = set()
    for pid in pids:
        try:
            for c in psutil.Process(pid).net_connections(kind="tcp"):
                # Reachable on 127.0.0.1 (gRPC listens IPv6 with IPv4-mapped addresses).
                if c.status == psutil.CONN_LISTEN and c.laddr.ip in LOOPBACK:
                    ports.add(c.laddr.port)
        except psutil.Error:
            pass  # a process that ended meanwhile has nothing to attack
    return sorted(ports)


class _Replay(flight.ClientMiddleware):
    def __init__(self, headers):
        super().__init__()
        self._headers = headers

    def sending_headers(self):
        return self._headers


class _ReplayFactory(flight.ClientMiddlewareFactory):
    def __init__(self, headers):
        super().__init__()
        self._headers = headers

    def start_call(self, info):
        return _Replay(self._headers)


def attempts(port: int, scheme: str, captured: dict | None):
    location = f"{scheme}://127.0.0.1:{port}"
    tls = {"disable_server_verification": True} if scheme == "grpc+tls" else {}
    plain = flight.FlightClient(location, **tls)
    options = flight.FlightCallOptions(timeout=3)

    def action(name, envelope, client=plain):
        body = envelope if isinstance(envelope, bytes) else json.dumps(envelope).encode()
        return list(client.do_action(flight.Action(name, body), options))

    yield "list_actions", lambda: list(plain.list_actions(options))
    for name in ACTIONS:
        yield f"{name}: no id", lambda n=name: action(n, {"body": {"member": 0}})
        yield f"{name}: null id", lambda n=name: action(n, {"execution_id": None,
                                                              "body": {"member": 0}})
        for guess in GUESSED_IDS:
            yield f"{name}: guessed id {guess}", lambda n=name, g=guess: action(
                n, {"execution_id": g, "body": {"member": 0, "error": "injected"}})
    forged = {"processor": "aggregate-0", "snapshot": 1,
              "manifest": {"snapshot_id": 1, "execution_id": 1, "entries": []}}
    for guess in GUESSED_IDS:
        yield f"forged ack, id {guess}", lambda g=guess: action(
            "ack", {"execution_id": g, "body": {"member": 0, **forged}})
    yield "poll", lambda: action("poll", {"execution_id": 1, "body": {"member": 0}})
    command = json.dumps({"protocol": "sparkjet.exchange/1", "execution_id": 1,
                          "vertex": "aggregate", "processor": 0, "channel": 0}).encode()

    def stream():
        writer, reader = plain.do_exchange(flight.FlightDescriptor.for_command(command),
                                           options)
        batch = pa.record_batch({"key": pa.array([1], pa.int64())})
        writer.begin(batch.schema)
        writer.write_batch(batch)
        reader.read_chunk()  # the server's handshake or its refusal
        writer.close()
        return "stream accepted"

    yield "data stream into a keyed processor", stream
    if captured is not None:
        replaying = flight.FlightClient(location, middleware=[_ReplayFactory(captured["headers"])],
                                        **tls)
        yield "replayed captured request", lambda: action(
            captured["action"], captured["body"].encode(), client=replaying)


def probe(port: int, scheme: str) -> str | None:
    """None if a Flight server answers on the port in this scheme (even if only to refuse
    the call), else why not (another protocol, or TLS against plain TCP)."""
    tls = {"disable_server_verification": True} if scheme == "grpc+tls" else {}
    client = flight.FlightClient(f"{scheme}://127.0.0.1:{port}", **tls)
    try:
        list(client.list_actions(flight.FlightCallOptions(timeout=3)))
    except (flight.FlightUnavailableError, flight.FlightTimedOutError) as e:
        return f"{type(e).__name__}: {e}"[:300]
    except Exception:  # noqa: BLE001 - any other answer came from a Flight server
        return None
    finally:
        client.close()
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pids", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--captured")
    args = parser.parse_args()
    captured = json.load(open(args.captured)) if args.captured else None
    report = []
    for port in listening_ports([int(p) for p in args.pids.split(",")]):
        for scheme in ("grpc+tcp", "grpc+tls"):
            answer = probe(port, scheme)
            if answer is not None:  # no Flight server speaking this scheme: nothing to attack
                report.append({"port": port, "scheme": scheme, "attack": "probe",
                               "accepted": False, "error": answer})
                continue
            for attack, call in attempts(port, scheme, captured):
                try:
                    call()
                except Exception as e:  # noqa: BLE001 - every refusal is an outcome to report
                    report.append({"port": port, "scheme": scheme, "attack": attack,
                                   "accepted": False, "error": f"{type(e).__name__}: {e}"[:300]})
                else:
                    report.append({"port": port, "scheme": scheme, "attack": attack,
                                   "accepted": True, "error": None})
    with open(args.report, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
