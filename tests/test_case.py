"""The case: canonical JSON, hashing, the zstd codec, and clear refusals."""
import pytest

from kfuzz.case import ArgCase, Case, Dist, Layout, decode, encode
from kfuzz.errors import CaseError

CASE = Case.make("softmax", "bfloat16", 1234, {"N": 3, "D": 100},
                 {"x": ArgCase(Layout("permuted", perm=(1, 0)), Dist("scaled", (("factor", 100.0),)),
                               ((7, "nan"), (12, "-inf"), (3, 2.5)))})


def test_roundtrip_and_hash_are_stable():
    case, record = decode(encode(CASE, {"expect": "fail"}))
    assert case == CASE and record == {"expect": "fail"}
    assert case.hash == CASE.hash
    assert Case.from_json(CASE.to_json()).canonical() == CASE.canonical()
    # the record does not enter the hash; the arguments' order does not matter
    assert decode(encode(CASE))[0].hash == CASE.hash


def test_default_args_are_dropped():
    c = Case.make("softmax", "float32", 0, {"N": 1, "D": 1}, {"x": ArgCase()})
    assert c.args == () and c.to_json()["args"] == {}


@pytest.mark.parametrize("data, message", [
    (b"not zstd at all", "not a valid zstd stream"),
    (encode(CASE)[:-7], "not a valid zstd stream"),
    (__import__("zstandard").ZstdCompressor().compress(b"{oops"), "not valid case JSON"),
    (__import__("zstandard").ZstdCompressor().compress(b'{"kfuzz": 99}'), "unsupported case schema"),
])
def test_corrupt_bytes_name_the_source(data, message):
    with pytest.raises(CaseError, match=message) as e:
        decode(data, "crashes/x/y.case.zst")
    assert "crashes/x/y.case.zst" in str(e.value)


@pytest.mark.parametrize("doc, message", [
    ({"layout": {"kind": "diagonal"}}, "unknown layout 'diagonal'"),
    ({"dist": "gaussianish"}, "unknown distribution 'gaussianish'"),
    ({"inject": [[3, "nanx"]]}, "unknown special value 'nanx'"),
    ({"inject": [[-1, "nan"]]}, "position must be an int >= 0"),
    ({"layout": {"kind": "permuted"}}, "needs 'perm'"),
    ({"colour": "red"}, "unknown keys"),
])
def test_malformed_argument_entries_are_refused(doc, message):
    with pytest.raises(CaseError, match=message):
        ArgCase.from_json(doc)
