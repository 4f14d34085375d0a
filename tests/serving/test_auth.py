"""API keys: the keys file, hashing, and how keys are presented."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tierlm.serving.auth import (ApiKeyAuth, NoAuth, RequestContext, hash_key, keys_file_line, load_keys_file,
                                 presented_key)
from tierlm.serving.errors import AuthenticationFailed


def test_keys_file_round_trip(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(f"# tenants\n{keys_file_line('alice', 'sk-a')}\n\n{keys_file_line('bob', 'sk-b')}  # ops\n")
    auth = ApiKeyAuth.from_file(path)
    assert auth.authenticate({"x-api-key": "sk-a"}) == "alice"
    assert auth.authenticate({"authorization": "Bearer sk-b"}) == "bob"
    with pytest.raises(AuthenticationFailed):
        auth.authenticate({"x-api-key": "sk-c"})
    assert "sk-a" not in path.read_text()  # only digests are stored


@pytest.mark.parametrize("content, words", [
    ("alice sk-plaintext\n", "expected '<key-id> sha256:<hex digest>'"),
    ("alice sha256:abc\n", "not a SHA-256 hex digest"),
    (f"a sha256:{hash_key('x')}\n# a comment\na sha256:{hash_key('y')}\n", ":3: key id 'a' appears twice (lines 1 and 3)"),
    ("# nothing\n", "no API keys found"),
])
def test_bad_keys_files_name_the_line(tmp_path, content, words):
    path = tmp_path / "keys.txt"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        load_keys_file(path)
    assert words in str(info.value) and str(path) in str(info.value)


def test_missing_keys_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read API keys file"):
        load_keys_file(tmp_path / "absent.txt")


@pytest.mark.parametrize("headers, key", [
    ({"x-api-key": "k1"}, "k1"), ({"authorization": "Bearer k2"}, "k2"), ({"authorization": "bearer  k3 "}, "k3"),
    ({"authorization": "Basic abc"}, None), ({}, None), ({"x-api-key": ""}, None),
])
def test_presented_key(headers, key):
    assert presented_key(headers) == key


def test_missing_key_says_how_to_send_one():
    with pytest.raises(AuthenticationFailed) as info:
        ApiKeyAuth.from_keys({"a": "k"}).authenticate({})
    assert "x-api-key" in info.value.message and "Bearer" in info.value.message
    assert NoAuth().authenticate({}) is None


def test_key_line_helper_module():
    out = subprocess.run([sys.executable, "-m", "tierlm.serving.auth", "carol"], input="sk-c", text=True,
                         capture_output=True, check=True).stdout.strip()
    assert out == f"carol sha256:{hash_key('sk-c')}"


def test_a_client_cache_salt_only_narrows_sharing():
    salts = [RequestContext("r", cache_salt=tenant).salted(client).cache_salt
             for tenant, client in [(None, None), (None, "x"), ("x", None), ("a", "bc"), ("ab", "c"), ("", "x"),
                                    ("t1", "x"), ("t2", "x")]]
    assert salts[0] is None and salts[2] == "x"  # no client salt: the tenant's, unchanged
    assert len(set(salts)) == len(salts) - 1  # all distinct but (None, "x") and ("", "x"): both "no tenant salt"
    assert salts[1] == salts[5]


def test_a_non_ascii_key_made_by_the_keys_tool_authenticates(tmp_path):
    """Clients send a header's UTF-8 bytes; Starlette decodes them as latin-1 before auth sees them."""
    from starlette.datastructures import Headers

    # "à" and "Å" end in bytes 0xA0 and 0x85: as latin-1, U+00A0 and U+0085, which str.strip()
    # takes for whitespace (those keys were refused).
    keys = {"carol": "sk-clé", "dave": "sk-voilà", "erin": "sk-Å"}
    lines = [subprocess.run([sys.executable, "-m", "tierlm.serving.auth", tenant], input=key, text=True,
                            encoding="utf-8", capture_output=True, check=True).stdout.strip()
             for tenant, key in keys.items()]
    path = tmp_path / "keys.txt"
    path.write_text("\n".join(lines) + "\n")
    auth = ApiKeyAuth.from_file(path)
    for tenant, key in keys.items():
        assert auth.authenticate(Headers(raw=[(b"x-api-key", key.encode())])) == tenant
        assert auth.authenticate(Headers(raw=[(b"authorization", f"Bearer {key} ".encode())])) == tenant
        # Python's requests and Node's fetch send such a key as latin-1 bytes: accepted as before.
        assert auth.authenticate(Headers(raw=[(b"x-api-key", key.encode("latin-1"))])) == tenant
    with pytest.raises(AuthenticationFailed):
        auth.authenticate(Headers(raw=[(b"x-api-key", "sk-cle".encode())]))
