"""Every S3 store of a process parses botocore's service model once (infra/storage/s3.py `_session`), while each
resolves its own credentials: a store made after the environment changed sees the new ones. No server: making a
client sends nothing."""

from __future__ import annotations

from trainforge.infra.storage.s3 import S3ObjectStore

ENDPOINT = "http://127.0.0.1:9"


def _access_key(store: S3ObjectStore) -> str:
    return store._client._request_signer._credentials.get_frozen_credentials().access_key


def test_stores_share_the_service_model_and_keep_their_own_credentials(monkeypatch):
    a = S3ObjectStore("b1", endpoint_url=ENDPOINT, access_key_id="key-a", secret_access_key="secret-a")
    b = S3ObjectStore("b2", endpoint_url=ENDPOINT, access_key_id="key-b", secret_access_key="secret-b")
    assert a._client._loader is b._client._loader
    assert (_access_key(a), _access_key(b)) == ("key-a", "key-b")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret-1")
    first = S3ObjectStore("b3", endpoint_url=ENDPOINT)  # boto3's own chain: the environment, read now
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret-2")
    second = S3ObjectStore("b3", endpoint_url=ENDPOINT)
    assert (_access_key(first), _access_key(second)) == ("env-1", "env-2")
