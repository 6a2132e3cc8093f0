"""Who may talk on a job's links: a secret per execution, a signed token on every call,
and TLS with a certificate the driver makes per job.

The driver draws a 256-bit secret (:mod:`secrets`) for every execution and hands it to the
members inside the Spark task closure, never in a progress event, a log line, a snapshot,
a file name or the Spark UI. Every Flight call a member or the coordinator makes carries
the header ``sparkjet-auth``:

    v1:<execution id>:<nonce>:<unix ms>:<HMAC-SHA256(secret, v1:<id>:<nonce>:<ms>:<method>)>

and every :class:`~sparkjet.runtime.exchange.ExchangeServer` checks it in server middleware
before any handler runs (``list_actions`` included): the signature, the execution (a token
of another execution, or none, is refused), the age (at most :data:`TOKEN_WINDOW` seconds
either way, for clock skew between hosts) and the nonce (each is accepted once, so a
captured request cannot be replayed). A refusal is a Flight authentication error, counted
by reason in :attr:`ServerAuth.refused`.

TLS (``JobConfig.tls``, on by default on a cluster master) encrypts the same links:
:meth:`TLSIdentity.self_signed` makes an ECDSA P-256 certificate on the driver for the
name :data:`SERVER_NAME`; every server presents it and every client trusts only it (the
certificate is pinned, so a server with another one is refused whatever its host name).
A user's own certificate and key may be given instead (``JobConfig.tls_certificate``).

>>> security = LinkSecurity.generate(execution_id=7)
>>> "secret" in repr(security) and security.secret.hex() not in repr(security)
True
>>> auth = ServerAuth(security)
>>> auth.check(security.token("DO_ACTION"), "DO_ACTION") is None
True
>>> token = security.token("DO_ACTION")
>>> auth.check(token, "DO_ACTION"), auth.check(token, "DO_ACTION")
(None, 'replayed')
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import secrets
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from pyarrow import flight

from sparkjet.errors import InvalidArgumentError

__all__ = ["HEADER", "SERVER_NAME", "TOKEN_WINDOW", "LinkSecurity", "ServerAuth",
           "TLSIdentity"]

#: The header that carries a call's token.
HEADER = "sparkjet-auth"
#: The name in a self-signed certificate, which clients check instead of the host name.
SERVER_NAME = "sparkjet"
#: How old (or, for clock skew, how far in the future) a token may be, in seconds.
TOKEN_WINDOW = 300.0
_VERSION = "v1"


@dataclass(frozen=True, repr=False)
class TLSIdentity:
    """A certificate and its private key (PEM), and the name clients expect in it."""

    certificate: bytes
    private_key: bytes
    server_name: str = SERVER_NAME

    @classmethod
    def self_signed(cls, days: int = 30) -> TLSIdentity:
        """A new ECDSA P-256 certificate for :data:`SERVER_NAME`, valid for ``days``."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=10))
                .not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]),
                               critical=False)
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(cert.public_bytes(serialization.Encoding.PEM),
                   key.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))

    @classmethod
    def from_files(cls, certificate: str, private_key: str,
                   server_name: str = SERVER_NAME) -> TLSIdentity:
        """The user's own certificate and key (PEM files); ``server_name`` must be a name
        the certificate holds."""
        try:
            cert, key = Path(certificate).read_bytes(), Path(private_key).read_bytes()
        except OSError as e:
            raise InvalidArgumentError(f"cannot read the TLS certificate or key: {e}") from e
        if b"-----BEGIN CERTIFICATE-----" not in cert:
            raise InvalidArgumentError(f"{certificate} is not a PEM certificate")
        if b"PRIVATE KEY-----" not in key:
            raise InvalidArgumentError(f"{private_key} is not a PEM private key")
        return cls(cert, key, server_name)

    def __repr__(self) -> str:
        return f"TLSIdentity(server_name={self.server_name!r}, private_key=<redacted>)"


@dataclass(frozen=True, repr=False)
class LinkSecurity:
    """The credentials of one execution's links: its id, its secret, and the TLS identity
    of the job (None: the links are not encrypted). Picklable, to travel to the members
    in the task closure; its ``repr`` never shows the secret or the key."""

    execution_id: int
    secret: bytes
    tls: TLSIdentity | None = None

    def __post_init__(self):
        if type(self.execution_id) is not int or self.execution_id < 0:
            raise InvalidArgumentError(
                f"execution_id must be an int >= 0, not {self.execution_id!r}")
        if not isinstance(self.secret, bytes) or len(self.secret) < 16:
            raise InvalidArgumentError("a link secret must be at least 16 random bytes")

    @classmethod
    def generate(cls, execution_id: int, tls: TLSIdentity | None = None) -> LinkSecurity:
        """A fresh secret for ``execution_id``."""
        return cls(execution_id, secrets.token_bytes(32), tls)

    def __repr__(self) -> str:
        return (f"LinkSecurity(execution_id={self.execution_id}, secret=<redacted>, "
                f"tls={self.tls is not None})")

    @property
    def scheme(self) -> str:
        """The Flight scheme of this execution's servers: ``grpc+tls`` or ``grpc+tcp``."""
        return "grpc+tls" if self.tls is not None else "grpc+tcp"

    def _mac(self, execution_id: int, nonce: str, millis: int, method: str) -> str:
        message = f"{_VERSION}:{execution_id}:{nonce}:{millis}:{method}".encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def token(self, method: str) -> str:
        """A token for one call of Flight method ``method`` (``"DO_ACTION"``, ...)."""
        nonce = secrets.token_hex(12)
        millis = int(time.time() * 1000)
        mac = self._mac(self.execution_id, nonce, millis, method)
        return f"{_VERSION}:{self.execution_id}:{nonce}:{millis}:{mac}"

    # -- Flight plumbing

    def client_middleware(self) -> list[flight.ClientMiddlewareFactory]:
        return [_ClientAuthFactory(self)]

    def client_options(self) -> dict:
        """Keyword arguments of ``flight.FlightClient`` for a server of this execution."""
        if self.tls is None:
            return {}
        return {"tls_root_certs": self.tls.certificate,
                "override_hostname": self.tls.server_name}

    def server_options(self) -> dict:
        """Keyword arguments of ``flight.FlightServerBase`` (middleware and TLS); the
        middleware under ``"sparkjet-auth"`` is the :class:`ServerAuth`."""
        options: dict = {"middleware": {HEADER: ServerAuth(self)}}
        if self.tls is not None:
            options["tls_certificates"] = [flight.CertKeyPair(self.tls.certificate,
                                                              self.tls.private_key)]
        return options


@dataclass(repr=False)
class _Seen:
    """Nonces accepted within the token window, oldest first."""

    expiry: OrderedDict = field(default_factory=OrderedDict)

    def add(self, nonce: str, now: float) -> bool:
        while self.expiry:
            first, until = next(iter(self.expiry.items()))
            if until > now:
                break
            del self.expiry[first]
        if nonce in self.expiry:
            return False
        self.expiry[nonce] = now + 2 * TOKEN_WINDOW
        return True


class ServerAuth(flight.ServerMiddlewareFactory):
    """Server middleware: refuses every call whose token does not check out, before any
    handler runs, and counts the refusals by reason (:attr:`refused`)."""

    def __init__(self, security: LinkSecurity):
        super().__init__()
        self._security = security
        self._lock = threading.Lock()
        self._seen = _Seen()
        #: refusals so far, by reason ("missing", "malformed", "other execution",
        #: "expired", "bad signature", "replayed")
        self.refused: Counter = Counter()

    def check(self, token: str | None, method: str) -> str | None:
        """None if ``token`` authorises one call of ``method``, else why not."""
        if not token:
            return "missing"
        parts = token.split(":")
        if len(parts) != 5 or parts[0] != _VERSION:
            return "malformed"
        _, execution, nonce, millis, mac = parts
        if not (execution.isdigit() and millis.isdigit() and len(nonce) == 24
                and len(mac) == 64):
            return "malformed"
        if int(execution) != self._security.execution_id:
            return "other execution"
        now = time.time()
        if abs(now - int(millis) / 1000) > TOKEN_WINDOW:
            return "expired"
        expected = self._security._mac(int(execution), nonce, int(millis), method)
        if not hmac.compare_digest(expected, mac):
            return "bad signature"
        with self._lock:
            if not self._seen.add(nonce, now):
                return "replayed"
        return None

    def start_call(self, info, headers):
        values = headers.get(HEADER) or headers.get(HEADER.encode()) or [None]
        token = values[0]
        if isinstance(token, bytes):
            token = token.decode("ascii", "replace")
        reason = self.check(token, info.method.name)
        if reason is not None:
            with self._lock:
                self.refused[reason] += 1
            raise flight.FlightUnauthenticatedError(
                f"sparkjet: call refused ({reason} credentials)")
        return None

    @property
    def refused_total(self) -> int:
        with self._lock:
            return sum(self.refused.values())


class _ClientAuth(flight.ClientMiddleware):
    def __init__(self, token: str):
        super().__init__()
        self._token = token

    def sending_headers(self):
        return {HEADER: self._token}


class _ClientAuthFactory(flight.ClientMiddlewareFactory):
    def __init__(self, security: LinkSecurity):
        super().__init__()
        self._security = security

    def start_call(self, info):
        return _ClientAuth(self._security.token(info.method.name))
