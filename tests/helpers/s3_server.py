"""A real S3 API for tests: moto's server on 127.0.0.1 (a free port), and pyarrow
filesystems on it. The ``s3`` fixture in conftest.py starts one per test module."""
import threading

import pyarrow.fs as pafs

BUCKET = "lake"


class AtomicWrites:
    """WSGI middleware running moto's writes one at a time. S3 applies each write
    atomically; moto checks ``If-None-Match`` and stores the object in two steps without a
    lock (moto 5.2, ``S3Response.put_object``), so two racing conditional puts could both
    pass it, and two plain puts of one key can fail one with a 500. Reads stay concurrent;
    the clients' requests interleave as they would on S3, so their races are as real."""

    def __init__(self, app):
        self.app, self.lock = app, threading.Lock()

    def __call__(self, environ, start_response):
        if environ["REQUEST_METHOD"] in ("GET", "HEAD"):
            return self.app(environ, start_response)
        with self.lock:
            return list(self.app(environ, start_response))


def _server(ip: str, port: int):
    """moto's threaded server on ``ip:port`` (0: a free port), with the middleware."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from moto.server import ThreadedMotoServer
    from werkzeug.serving import make_server

    class Server(ThreadedMotoServer):
        def _server_entry(self):    # moto's own, with the middleware around the app
            app = AtomicWrites(DomainDispatcherApplication(create_backend_app))
            self._server = make_server(self._ip_address, self._port, app, True,
                                       request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    return Server(ip_address=ip, port=port, verbose=False)


def start():
    """Starts a moto server with the bucket ``lake``; returns the server and its endpoint."""
    server = _server("127.0.0.1", 0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"{host}:{port}"
    s3_filesystem(endpoint, allow_bucket_creation=True).create_dir(BUCKET)
    return server, endpoint


def halt(server) -> None:
    """Stops answering (the listening socket closes); the objects stay (moto keeps them
    in this process), for :func:`restart`."""
    server.stop()


def restart(endpoint: str):
    """A server again on ``endpoint`` (host:port) after :func:`halt`, holding what the
    halted one held; returns it (stop it with ``.stop()``)."""
    host, _, port = endpoint.rpartition(":")
    server = _server(host, int(port))
    server.start()
    return server


def s3_filesystem(endpoint, **options):
    """A pyarrow S3FileSystem on the server: short timeouts, no retries (a test that
    hangs on a dead endpoint proves nothing)."""
    options.setdefault("retry_strategy", pafs.AwsStandardS3RetryStrategy(max_attempts=1))
    return pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", access_key="x",
                             secret_key="x", region="us-east-1", connect_timeout=2,
                             request_timeout=5, **options)


def s3_uri(path, endpoint):
    """``s3://path`` on the server, as a URI string (credentials from the environment)."""
    return f"s3://{path}?endpoint_override={endpoint}&scheme=http&region=us-east-1"
