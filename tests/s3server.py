"""A real S3 API on 127.0.0.1 for the tests: moto in server mode (as s3fs's own test suite does).

The server runs in a thread of the test process on a free port (``port=0``), is shared by the whole
session and stopped at its end. Each test gets its own bucket, and an environment that points botocore
at the server through the standard variables only (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), so
the code under test and CLI subprocesses configure themselves exactly as they would against AWS.

Use in a test module::

    from s3server import s3_server, s3_env, s3_url  # noqa: F401  (pytest fixtures)

Why a server and not ``mock_aws``: ``mock_aws`` patches botocore in-process and cannot reach a CLI
subprocess (kill/resume tests), and s3fs's async client bypasses parts of it. A server on loopback is
the real HTTP path.

Authentication: moto accepts any key by default. :meth:`S3Server.enforce_auth` turns IAM checking on
(moto's ``reset-auth``) so that an unknown access key is refused with ``InvalidAccessKeyId`` (HTTP 403),
as AWS does. It stays off otherwise because moto 5.2 miscomputes the signature of list requests that
carry a ``prefix`` even for valid keys.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import urllib.request
from dataclasses import dataclass

import pytest

REGION = "us-east-1"
_bucket_numbers = itertools.count(1)


@dataclass
class S3Server:
    endpoint: str
    key_id: str
    secret: str

    def client(self, key_id: str | None = None, secret: str | None = None):
        """A plain boto3 S3 client on the server (for test set-up and for tampering with objects)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=key_id or self.key_id,
                            aws_secret_access_key=secret or self.secret)

    def new_bucket(self, prefix: str = "ckpt-test") -> str:
        name = f"{prefix}-{os.getpid()}-{next(_bucket_numbers)}"
        self.client().create_bucket(Bucket=name)
        return name

    def _set_auth(self, count: str) -> None:
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=count.encode(),
                                     method="POST", headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200

    @contextlib.contextmanager
    def enforce_auth(self):
        """While inside, requests with an unknown access key fail with 403 InvalidAccessKeyId."""
        self._set_auth("0")
        try:
            yield
        finally:
            self._set_auth("inf")

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point any botocore client (this process or a child) here."""
        return {
            "AWS_ACCESS_KEY_ID": self.key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
            # Never read the developer's own profile, credentials or config.
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }


_UNSET = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
          "AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "FSSPEC_S3")


_running: dict = {}


def _start() -> tuple[object, S3Server]:
    import uuid

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        # An IAM user with full rights, so that enforce_auth() has one valid key to compare with.
        iam = boto3.client("iam", endpoint_url=endpoint, region_name=REGION,
                           aws_access_key_id="setup", aws_secret_access_key="setup")
        user = f"ckpt-archive-tests-{uuid.uuid4().hex[:8]}"
        iam.create_user(UserName=user)
        iam.put_user_policy(UserName=user, PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName=user)["AccessKey"]
    except BaseException:
        server.stop()
        raise
    return server, S3Server(endpoint, key["AccessKeyId"], key["SecretAccessKey"])


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 (a free port), one for the whole session, stopped at its end.

    Each test module imports this fixture, which makes one fixture per module; ``_running`` keeps it
    to one server (moto's backend state is process-wide anyway).
    """
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    if "server" not in _running:
        _running["server"], _running["info"] = _start()
    try:
        yield _running["info"]
    finally:
        server = _running.pop("server", None)
        _running.pop("info", None)
        if server is not None:
            server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """Point this process's botocore at the server through the standard AWS variables only."""
    for name in _UNSET:
        monkeypatch.delenv(name, raising=False)
    env = s3_server.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def s3_url(s3_server, s3_env):
    """``s3://<fresh bucket>/repo``: an empty repository URL on the server."""
    return f"s3://{s3_server.new_bucket()}/repo"
