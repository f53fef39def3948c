"""One contract every Store must pass (restic's ``internal/backend/test`` habit).

The repository's publish protocol relies on exactly these behaviours, on every store: write-once
members never overwrite, ``claim`` is an exclusive create, the marker can be replaced whole, listing
shows what another writer just created, deletion of absent keys is harmless, missing objects raise
:class:`NotFound`.

Kinds and why each earns its cost:
* ``local``: the default store, fsyncs; the reference behaviour.
* ``s3``: s3fs against moto's S3 server on 127.0.0.1 (real HTTP, real multipart uploads and
  conditional writes). Object stores have no rename and no directories: the cases that differ most.
"""
from __future__ import annotations

import hashlib
import os

import pytest

from ckpt_archive.errors import NotFound, StoreError
from s3server import s3_env, s3_server, s3_url  # noqa: F401  (pytest fixtures)

MIB = 2**20


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        from ckpt_archive.store.local import LocalStore

        return LocalStore(tmp_path / "store")
    url = request.getfixturevalue("s3_url")
    from ckpt_archive.store.fsspec_store import FsspecStore

    # 5 MiB parts (S3's minimum) so that the multipart path is exercised with a small payload.
    return FsspecStore(url, storage_options={"default_block_size": 5 * MIB})


def test_open_store_dispatches_urls_to_fsspec_and_paths_to_local(tmp_path, s3_url):
    from ckpt_archive.store.base import open_store
    from ckpt_archive.store.local import LocalStore
    from ckpt_archive.store.fsspec_store import FsspecStore

    assert isinstance(open_store(tmp_path / "r"), LocalStore)
    remote = open_store(s3_url)
    assert isinstance(remote, FsspecStore)
    assert remote.location == s3_url and remote.is_local is False


def test_write_bytes_once_reads_back_identical(store):
    store.write_bytes_once("generations/00000001/a.bin", b"hello\x00world")
    assert store.exists("generations/00000001/a.bin")
    assert store.read_bytes("generations/00000001/a.bin") == b"hello\x00world"
    assert store.size("generations/00000001/a.bin") == 11


def test_write_once_refuses_to_overwrite_and_keeps_first_content(store):
    store.write_bytes_once("m.ckz", b"first")
    with pytest.raises(StoreError):
        store.write_bytes_once("m.ckz", b"second")
    with pytest.raises(StoreError):
        with store.write_once("m.ckz") as fh:
            fh.write(b"third")
    assert store.read_bytes("m.ckz") == b"first"


def test_streamed_write_once_over_several_parts_is_byte_exact(store):
    data = os.urandom(11 * MIB + 123)  # three multipart parts on s3
    with store.write_once("big/member.ckz") as fh:
        for i in range(0, len(data), MIB):
            fh.write(data[i:i + MIB])
    assert store.size("big/member.ckz") == len(data)
    with store.open_read("big/member.ckz") as fh:
        got = hashlib.sha256()
        while chunk := fh.read(3 * MIB + 7):
            got.update(chunk)
    assert got.hexdigest() == hashlib.sha256(data).hexdigest()


def test_streamed_write_once_refuses_existing_multipart_object(store):
    data = os.urandom(11 * MIB)
    store.write_bytes_once("big.ckz", data)
    with pytest.raises(StoreError):
        with store.write_once("big.ckz") as fh:
            fh.write(os.urandom(11 * MIB))
    assert store.read_bytes("big.ckz") == data


def test_claim_is_exclusive(store):
    assert store.claim("generations/00000007/.claim") is True
    assert store.claim("generations/00000007/.claim") is False
    assert store.exists("generations/00000007/.claim")


def test_replace_bytes_replaces_whole_object(store):
    store.replace_bytes("generations/00000001/USABLE.json", b'{"a": 1, "long": "xxxxxxxx"}')
    store.replace_bytes("generations/00000001/USABLE.json", b'{"a": 2}')
    assert store.read_bytes("generations/00000001/USABLE.json") == b'{"a": 2}'


def test_listdir_shows_children_once_and_missing_prefix_is_empty(store):
    store.write_bytes_once("generations/00000001/manifest.json", b"{}")
    store.write_bytes_once("generations/00000001/m0.ckz", b"x")
    store.write_bytes_once("generations/00000002/manifest.json", b"{}")
    store.write_bytes_once("repository.json", b"{}")
    assert store.listdir("generations") == ["00000001", "00000002"]
    assert store.listdir("generations/00000001") == ["m0.ckz", "manifest.json"]
    assert "generations" in store.listdir("") and "repository.json" in store.listdir("")
    assert store.listdir("generations/00000099") == []


def test_listing_sees_objects_written_through_another_store_instance(store, tmp_path):
    """A reader must see a marker another process just wrote: no stale listing cache."""
    assert store.listdir("generations") == []
    other = _twin(store)
    other.write_bytes_once("generations/00000003/USABLE.json", b"{}")
    assert store.listdir("generations") == ["00000003"]
    assert store.exists("generations/00000003/USABLE.json")


def test_missing_object_raises_not_found_naming_the_key(store):
    for read in (store.read_bytes, store.size, store.open_read):
        with pytest.raises(NotFound) as info:
            read("generations/00000001/nope.ckz")
        assert "nope.ckz" in str(info.value)
    assert store.exists("generations/00000001/nope.ckz") is False


def test_remove_and_remove_prefix_are_idempotent(store):
    store.write_bytes_once("generations/00000001/USABLE.json", b"{}")
    store.write_bytes_once("generations/00000001/m0.ckz", b"x")
    store.write_bytes_once("generations/00000002/m0.ckz", b"y")
    store.remove("generations/00000001/USABLE.json")
    store.remove("generations/00000001/USABLE.json")
    assert not store.exists("generations/00000001/USABLE.json")
    store.remove_prefix("generations/00000001")
    store.remove_prefix("generations/00000001")
    assert store.listdir("generations") == ["00000002"]
    assert store.read_bytes("generations/00000002/m0.ckz") == b"y"


def test_open_read_seeks(store):
    store.write_bytes_once("s.bin", bytes(range(256)) * 4)
    with store.open_read("s.bin") as fh:
        fh.seek(250)
        assert fh.read(10) == bytes(range(250, 256)) + bytes(range(4))
        assert fh.tell() == 260


def test_fsync_dir_is_accepted(store):
    store.write_bytes_once("d/x", b"1")
    store.fsync_dir("d")
    store.fsync_dir("")


def test_store_says_where_it_locks_its_free_space_and_its_local_path(store, tmp_path):
    """Callers must not branch on the kind of store: what they need (a lock file, free space, a local
    path to refuse writing into) comes from the protocol, the same way for every store."""
    from ckpt_archive.store.local import LocalStore

    lock = store.lock_file()
    assert lock.name.endswith(".lock")
    assert lock.parent.is_dir() or isinstance(store, LocalStore)
    free = store.free_bytes()
    assert free is None or (isinstance(free, int) and free > 0)
    local = store.local_path("g/x")
    if isinstance(store, LocalStore):
        assert local == tmp_path / "store" / "g" / "x" and lock == tmp_path / "store" / ".lock"
        assert isinstance(free, int)
    else:
        assert local is None and free is None
        assert lock == _twin(store).lock_file()  # one lock per URL, whatever the instance


def _twin(store):
    from ckpt_archive.store.local import LocalStore
    from ckpt_archive.store.fsspec_store import FsspecStore

    if isinstance(store, LocalStore):
        return LocalStore(store.root)
    return FsspecStore(store.location)


# --- s3 only: what a local folder cannot show ------------------------------------------------------
def test_s3_aborted_streamed_write_leaves_no_object(s3_url):
    from ckpt_archive.store.fsspec_store import FsspecStore

    store = FsspecStore(s3_url, storage_options={"default_block_size": 5 * MIB})
    with pytest.raises(RuntimeError):
        with store.write_once("g/m.ckz") as fh:
            fh.write(os.urandom(6 * MIB))  # one part already uploaded
            raise RuntimeError("crash mid-member")
    assert not store.exists("g/m.ckz")
    with store.write_once("g/m.ckz") as fh:  # the key is still free
        fh.write(b"ok")
    assert store.read_bytes("g/m.ckz") == b"ok"


def test_s3_conditional_write_refuses_a_racing_writer(s3_server, s3_url):
    """Two writers pass the existence check; the store itself (If-None-Match) refuses the second."""
    from ckpt_archive.store.fsspec_store import FsspecStore

    first, second = FsspecStore(s3_url), FsspecStore(s3_url)
    with pytest.raises(StoreError):
        with second.write_once("gen/marker") as late:
            late.write(b"late")
            first.write_bytes_once("gen/marker", b"early")
    assert first.read_bytes("gen/marker") == b"early"


def test_s3_endpoint_url_argument_overrides_environment(s3_server, s3_env, monkeypatch):
    from ckpt_archive.store.fsspec_store import FsspecStore

    bucket = s3_server.new_bucket()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    store = FsspecStore(f"s3://{bucket}/r", endpoint_url=s3_server.endpoint)
    store.write_bytes_once("x", b"1")
    assert store.read_bytes("x") == b"1"


def test_s3_service_specific_endpoint_variable_is_honoured(s3_server, s3_env, monkeypatch):
    from ckpt_archive.store.fsspec_store import FsspecStore

    bucket = s3_server.new_bucket()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)
    store = FsspecStore(f"s3://{bucket}/r")
    store.write_bytes_once("x", b"1")
    assert store.listdir("") == ["x"]


def test_s3_unknown_access_key_is_a_store_error_with_a_hint(s3_server, s3_url, monkeypatch):
    from ckpt_archive.store.fsspec_store import FsspecStore

    FsspecStore(s3_url).write_bytes_once("x", b"1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    store = FsspecStore(s3_url)
    with s3_server.enforce_auth():
        for op in (lambda: store.read_bytes("x"), lambda: store.listdir(""), lambda: store.exists("x"),
                   lambda: store.write_bytes_once("y", b"2"), lambda: store.claim("z")):
            with pytest.raises(StoreError) as info:
                op()
            assert str(info.value).startswith(f"{s3_url}: access denied (")
            assert "AWS_ACCESS_KEY_ID" in str(info.value)
    assert not FsspecStore(s3_url).exists("y")


def test_s3_unreachable_endpoint_is_a_store_error(s3_env, monkeypatch):
    from ckpt_archive.store.fsspec_store import FsspecStore

    store = FsspecStore("s3://no-such-place/r", endpoint_url="http://127.0.0.1:9",
                        storage_options={"config_kwargs": {"retries": {"max_attempts": 1},
                                                           "connect_timeout": 1}})
    store.fs.retries = 1  # s3fs's own retry loop (a class attribute): keep the test fast
    with pytest.raises(StoreError) as info:
        store.read_bytes("x")
    assert "s3://no-such-place/r" in str(info.value)


def test_s3_server_side_encryption_passes_through(s3_server, s3_url):
    from ckpt_archive.store.fsspec_store import FsspecStore

    store = FsspecStore(s3_url, storage_options={"s3_additional_kwargs": {"ServerSideEncryption": "AES256"}})
    store.write_bytes_once("enc/one", b"secret")
    with store.write_once("enc/two") as fh:
        fh.write(b"streamed")
    bucket, prefix = s3_url[len("s3://"):].split("/", 1)
    client = s3_server.client()
    for key in ("enc/one", "enc/two"):
        assert client.head_object(Bucket=bucket, Key=f"{prefix}/{key}")["ServerSideEncryption"] == "AES256"


def test_s3_write_to_a_missing_bucket_says_so(s3_env):
    from ckpt_archive.store.fsspec_store import FsspecStore

    store = FsspecStore("s3://no-such-bucket-here/r")
    assert store.exists("x") is False and store.listdir("") == []
    with pytest.raises(StoreError) as info:
        store.write_bytes_once("x", b"1")
    assert "bucket does not exist" in str(info.value)
    with pytest.raises(StoreError):
        store.claim("generations/00000001/CLAIM")


def test_s3_missing_credentials_is_a_store_error_not_anonymous_access(s3_server, s3_url, monkeypatch):
    from ckpt_archive.store.fsspec_store import FsspecStore

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    store = FsspecStore(s3_url)
    with s3_server.enforce_auth():
        with pytest.raises(StoreError) as info:
            store.write_bytes_once("x", b"1")
    assert "no usable credentials" in str(info.value) and "AWS_ACCESS_KEY_ID" in str(info.value)


def test_writer_lock_excludes_a_second_holder_and_says_who_holds_it(store, tmp_path, monkeypatch):
    """Every store's writer lock (through the file layer, on the repository or in the user's cache): a
    second holder is refused while the first holds it, the owner file says who, and a release frees it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first, second = store.writer_lock(), _twin(store).writer_lock()
    assert first.acquire(timeout=0)
    try:
        first.write_owner(b'{"pid": 1}')
        assert not second.acquire(timeout=0.1)  # another open of the same lock file: refused, even in-process
        assert second.read_owner() == b'{"pid": 1}'
    finally:
        first.release()
    assert second.read_owner() is None  # removed on release
    assert second.acquire(timeout=0)
    second.release()
