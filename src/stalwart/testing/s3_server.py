"""``S3Server``: a local S3 endpoint (moto) on loopback, for tests of S3-backed storage.

Tests talk to it over real HTTP through s3fs and boto3, exactly as they would to AWS, so the
PUT / ranged GET / list paths and the error translation are exercised end to end. The server
binds an ephemeral port on 127.0.0.1, sets no environment variables, and stops on exit.
Needs the ``dev`` extra (``moto[server]``, ``boto3``).
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from types import TracebackType
from typing import Any

from stalwart.errors import ConfigError

__all__ = ["S3Server"]

logger = logging.getLogger(__name__)

_KEY = "testing"
_SECRET = "testing"
_REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """A moto S3 server on ``127.0.0.1``; use as a context manager.

    Runs moto's ``ThreadedMotoServer`` in this process when available, else
    ``python -m moto.server`` in a subprocess.

    Args:
        start_timeout_s: how long to wait for a subprocess server to answer.
    """

    def __init__(self, *, start_timeout_s: float = 30.0) -> None:
        self.start_timeout_s = start_timeout_s
        self.endpoint_url = ""
        self._threaded: Any = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def storage_options(self) -> dict[str, Any]:
        """Options for s3fs (``FsspecStorage(..., storage_options=...)``)."""
        return {
            "key": _KEY,
            "secret": _SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": _REGION},
        }

    def start(self) -> S3Server:
        """Start the server and wait until it answers; return ``self``."""
        try:
            from moto.server import ThreadedMotoServer
        except ImportError:  # older moto: run the CLI server instead
            threaded_cls: Any = None
        else:
            threaded_cls = ThreadedMotoServer
        if threaded_cls is not None:
            server = threaded_cls(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            host, port = server.get_host_and_port()
            self._threaded = server
            self.endpoint_url = f"http://{host}:{port}"
        else:
            port = _free_port()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self.endpoint_url = f"http://127.0.0.1:{port}"
        self._wait_ready()
        logger.info("moto S3 server listening on %s", self.endpoint_url)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=1.0):
                    return
            except urllib.error.HTTPError:
                return  # it answered, with any status: it is up
            except OSError as e:
                if self._proc is not None and self._proc.poll() is not None:
                    raise ConfigError(
                        f"moto server exited with code {self._proc.returncode}; is "
                        "moto[server] installed? pip install 'stalwart[dev]'"
                    ) from e
                if time.monotonic() > deadline:
                    self.stop()
                    raise ConfigError(
                        f"moto server at {self.endpoint_url} did not answer within "
                        f"{self.start_timeout_s} s"
                    ) from e
                time.sleep(0.05)

    def stop(self) -> None:
        """Stop the server; safe to call twice."""
        if self._threaded is not None:
            self._threaded.stop()
            self._threaded = None
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def client(self) -> Any:
        """A boto3 S3 client for this server."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=_KEY,
            aws_secret_access_key=_SECRET,
            region_name=_REGION,
        )

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name``; return it."""
        self.client().create_bucket(Bucket=name)
        return name

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
