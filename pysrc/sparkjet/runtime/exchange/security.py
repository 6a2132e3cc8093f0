"""Who may talk on a job's links: a secret per execution, a signed token on every call,
and TLS with a certificate the driver makes per execution.

The driver draws a 256-bit secret (:mod:`secrets`) for every execution and hands it to the
members inside the Spark task closure, never in a progress event, a log line, a snapshot,
a file name or the Spark UI. Every Flight call a member or the coordinator makes carries
the header ``sparkjet-auth``:

    v1:<execution id>:<nonce>:<unix ms>:<digest>:<HMAC-SHA256 over all of them, the
    call's method and the server's location>

where the digest is the SHA-256 of an action's type and body ("-" for other calls). Every
:class:`~sparkjet.runtime.exchange.ExchangeServer` checks it in server middleware before any
handler runs (``list_actions`` included): the signature first (a token of another
execution, for another server or another call is refused), then the age (at most
:data:`TOKEN_WINDOW` seconds either way, for clock skew between hosts) and the nonce (each
is accepted once per server, so a captured request cannot be replayed); an action's
handler then checks the body against the digest. A refusal says only "unauthenticated"
to the caller (nothing about ids or clocks) and is counted by reason in
:attr:`ServerAuth.refused`.

TLS (``JobConfig.tls``, on by default on a cluster master) encrypts the same links:
:meth:`TLSIdentity.self_signed` makes an ECDSA P-256 certificate on the driver for the
name :data:`SERVER_NAME`, anew for every execution (so a zombie holds no key of the
current one, and a job that runs for months never meets an expired certificate); every
server presents it and every client trusts only it (the certificate is pinned, so a
server with another one is refused whatever its host name). A user's own certificate
and key may be given instead (``JobConfig.tls_certificate``): its leaf is pinned, never
the CAs that may follow it in the file.

The secret and the key reach the members inside Spark's task closure: on a shared cluster,
turn on Spark's own ``spark.authenticate`` and ``spark.network.crypto.enabled``, or a
sniffer of Spark's traffic learns them (the runner warns when a cluster lacks them).

>>> security = LinkSecurity.generate(execution_id=7)
>>> "secret" in repr(security) and security.secret.hex() not in repr(security)
True
>>> auth = ServerAuth(security, "grpc+tcp://127.0.0.1:1")
>>> token = security.token("DO_ACTION", "grpc+tcp://127.0.0.1:1")
>>> auth.check(token, "DO_ACTION")[0], auth.check(token, "DO_ACTION")[0]
(None, 'replayed')
>>> auth.check(security.token("DO_ACTION", "grpc+tcp://127.0.0.1:2"), "DO_ACTION")[0]
'bad signature'
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

from pyarrow import flight

from sparkjet.errors import InvalidArgumentError

__all__ = ["HEADER", "REFUSAL", "SERVER_NAME", "TOKEN_WINDOW", "CallAuth", "LinkSecurity",
           "ServerAuth", "TLSIdentity", "action_digest", "check_link_security"]

#: The header that carries a call's token.
HEADER = "sparkjet-auth"
#: The name in a self-signed certificate, which clients check instead of the host name.
SERVER_NAME = "sparkjet"
#: How old (or, for clock skew, how far in the future) a token may be, in seconds.
TOKEN_WINDOW = 300.0
#: What a refused caller is told, whatever the reason (the reason is only counted).
REFUSAL = "sparkjet: call refused (unauthenticated)"
_VERSION = "v1"
_NO_DIGEST = "-"
_log = logging.getLogger("sparkjet.security")


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
        return cls.checked(cert, key, server_name, f"{certificate} and {private_key}")

    @classmethod
    def checked(cls, certificate: bytes, private_key: bytes, server_name: str = SERVER_NAME,
                where: str = "the TLS identity") -> TLSIdentity:
        """The leaf (first) certificate of a PEM chain with its key, after checking that
        they belong together, that the certificate holds ``server_name`` and that it is
        valid now. Only the leaf is kept: clients pin it, never a CA of the chain."""
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        try:
            leaf = x509.load_pem_x509_certificates(certificate)[0]
        except ValueError as e:
            raise InvalidArgumentError(f"{where}: not a PEM certificate ({e})") from None
        try:
            key = serialization.load_pem_private_key(private_key, password=None)
        except (ValueError, TypeError) as e:
            raise InvalidArgumentError(
                f"{where}: not an unencrypted PEM private key ({type(e).__name__})") from None
        pem = serialization.Encoding.PEM
        info = serialization.PublicFormat.SubjectPublicKeyInfo
        if (key.public_key().public_bytes(pem, info)
                != leaf.public_key().public_bytes(pem, info)):
            raise InvalidArgumentError(f"{where}: the private key is not the certificate's")
        try:
            names = leaf.extensions.get_extension_for_class(
                x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
        except x509.ExtensionNotFound:
            names = []
        if server_name not in names:
            raise InvalidArgumentError(
                f"{where}: the certificate names {names or 'no DNS name'}, not the server "
                f"name {server_name!r} (tls_server_name)")
        now = datetime.datetime.now(datetime.timezone.utc)
        if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
            raise InvalidArgumentError(
                f"{where}: the certificate is valid from {leaf.not_valid_before_utc} to "
                f"{leaf.not_valid_after_utc}, not now")
        return cls(leaf.public_bytes(pem), private_key, server_name)

    def __repr__(self) -> str:
        return f"TLSIdentity(server_name={self.server_name!r}, private_key=<redacted>)"


@dataclass(frozen=True, repr=False)
class LinkSecurity:
    """The credentials of one execution's links: its id, its secret, and its TLS identity
    (None: the links are not encrypted). Picklable, to travel to the members
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

    def _mac(self, execution: str, nonce: str, millis: str, digest: str, method: str,
             audience: str) -> str:
        message = f"{_VERSION}:{execution}:{nonce}:{millis}:{digest}:{method}:{audience}"
        return hmac.new(self.secret, message.encode(), hashlib.sha256).hexdigest()

    def token(self, method: str, audience: str, digest: str = _NO_DIGEST) -> str:
        """A token for one call of Flight method ``method`` (``"DO_ACTION"``, ...) to the
        server at ``audience`` (its location), for an action with ``digest``
        (:func:`action_digest`)."""
        nonce = secrets.token_hex(12)
        millis = str(int(time.time() * 1000))
        mac = self._mac(str(self.execution_id), nonce, millis, digest, method, audience)
        return f"{_VERSION}:{self.execution_id}:{nonce}:{millis}:{digest}:{mac}"

    # -- Flight plumbing

    def call_options(self, method: str, audience: str, *, timeout: float | None = None,
                     action: str | None = None, body: bytes = b"") -> flight.FlightCallOptions:
        """Call options carrying a fresh token for one call (for an action, bound to its
        type and body)."""
        digest = action_digest(action, body) if action is not None else _NO_DIGEST
        token = self.token(method, audience, digest)
        return flight.FlightCallOptions(timeout=timeout,
                                        headers=[(HEADER.encode(), token.encode())])

    def client_options(self) -> dict:
        """Keyword arguments of ``flight.FlightClient`` for a server of this execution."""
        if self.tls is None:
            return {}
        return {"tls_root_certs": self.tls.certificate,
                "override_hostname": self.tls.server_name}

    def server_options(self) -> dict:
        """Keyword arguments of ``flight.FlightServerBase`` (middleware and TLS); the
        middleware under ``"sparkjet-auth"`` is the :class:`ServerAuth`, whose
        ``audience`` the server sets to its location once it is bound."""
        options: dict = {"middleware": {HEADER: ServerAuth(self)}}
        if self.tls is not None:
            options["tls_certificates"] = [flight.CertKeyPair(self.tls.certificate,
                                                              self.tls.private_key)]
        return options


class _Seen:
    """Nonces accepted within the token window, oldest first."""

    def __init__(self):
        self.expiry: OrderedDict[str, float] = OrderedDict()

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


def action_digest(action: str, body: bytes) -> str:
    """The SHA-256 of an action's type and body, which its token is bound to."""
    return hashlib.sha256(action.encode() + b"\0" + bytes(body)).hexdigest()


def check_link_security(security) -> None:
    """Refuses (:class:`~sparkjet.errors.InvalidArgumentError`) a ``security`` that is not
    a :class:`LinkSecurity`: what every exchange server and client must be given."""
    if not isinstance(security, LinkSecurity):
        raise InvalidArgumentError(
            f"security must be a LinkSecurity, not {type(security).__name__}")


class CallAuth(flight.ServerMiddleware):
    """What a call's accepted token promised: the action digest its handler must match."""

    def __init__(self, digest: str):
        super().__init__()
        self.digest = digest


class ServerAuth(flight.ServerMiddlewareFactory):
    """Server middleware: refuses every call whose token does not check out, before any
    handler runs, and counts the refusals by reason (:attr:`refused`). ``audience`` is
    the server's own location, which tokens must name."""

    def __init__(self, security: LinkSecurity, audience: str = ""):
        super().__init__()
        self._security = security
        self.audience = audience
        self._lock = threading.Lock()
        self._seen = _Seen()
        self._refused: Counter = Counter()

    @property
    def refused(self) -> dict[str, int]:
        """Refusals so far by reason ("missing", "malformed", "bad signature" (a forgery,
        another execution's or another server's token), "expired", "replayed",
        "body mismatch")."""
        with self._lock:
            return dict(self._refused)

    def count(self, reason: str) -> None:
        with self._lock:
            self._refused[reason] += 1
            n = self._refused[reason]
        # Logged at the 1st, 10th, 100th... refusal of each kind: a flood of bad calls
        # must not flood the log too.
        if str(n).rstrip("0") == "1":
            _log.warning("%s refused %d call(s) so far: %s credentials", self.audience, n,
                         reason)

    def check(self, token: str | None, method: str) -> tuple[str | None, str]:
        """(None, digest) if ``token`` authorises one call of ``method`` here, else
        (why not, "")."""
        if not token:
            return "missing", ""
        parts = token.split(":")
        if len(parts) != 6 or parts[0] != _VERSION:
            return "malformed", ""
        _, execution, nonce, millis, digest, mac = parts
        # Bounded, plain ASCII digits: nothing an attacker sends can make int() or the
        # arithmetic below raise.
        if not (execution.isascii() and execution.isdigit() and len(execution) <= 19
                and millis.isascii() and millis.isdigit() and len(millis) <= 15
                and len(nonce) == 24 and len(mac) == 64
                and (digest == _NO_DIGEST or len(digest) == 64)):
            return "malformed", ""
        # The signature first: a refusal must teach nothing about ids or clocks.
        expected = self._security._mac(execution, nonce, millis, digest, method,
                                       self.audience)
        if not hmac.compare_digest(expected, mac):
            return "bad signature", ""
        if int(execution) != self._security.execution_id:
            return "bad signature", ""
        now = time.time()
        if abs(now - int(millis) / 1000) > TOKEN_WINDOW:
            return "expired", ""
        with self._lock:
            if not self._seen.add(nonce, now):
                return "replayed", ""
        return None, digest

    def start_call(self, info, headers):
        values = headers.get(HEADER) or headers.get(HEADER.encode()) or [None]
        token = values[0]
        if isinstance(token, bytes):
            token = token.decode("ascii", "replace")
        try:
            reason, digest = self.check(token, info.method.name)
        except Exception:  # noqa: BLE001 - whatever a caller sends is at worst malformed
            reason, digest = "malformed", ""
        if reason is not None:
            self.count(reason)
            raise flight.FlightUnauthenticatedError(REFUSAL)
        return CallAuth(digest)


