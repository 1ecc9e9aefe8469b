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


# a case file from outside --------------------------------------------------------------------

def _doc(**changes):
    return {"kfuzz": 1, "target": "softmax", "dtype": "float32", "seed": 1, "dims": {"N": 4, "D": 33}, **changes}


def _file(doc) -> bytes:
    return __import__("zstandard").ZstdCompressor().compress(__import__("json").dumps(doc).encode())


@pytest.mark.parametrize("args, message", [
    ({"x": {"layout": {"kind": "offset", "offset": 1e9}}}, "offset must be an integer, got 1000000000.0"),
    ({"x": {"layout": {"kind": "strided", "step": [1e5, 1e5]}}}, "step entry must be an integer"),
    ({"x": {"layout": {"kind": "permuted", "perm": [1.0, 0]}}}, "perm entry must be an integer"),
    ({"x": {"layout": {"kind": "expanded", "dims": [True]}}}, "dims entry must be an integer"),
    ({"x": {"layout": {"kind": "strided", "step": "12"}}}, "must be a list of integers"),
    ({"x": {"inject": [[1.0, "nan"]]}}, "position must be an int"),
    ({"x": {"inject": 3}}, "injections must be a list"),
    ({"x": {"dist": {"kind": "scaled", "factor": "big"}}}, "must be a number, got 'big'"),
])
def test_floats_and_strings_where_integers_belong_are_refused(args, message):
    with pytest.raises(CaseError, match=message) as e:
        decode(_file(_doc(args=args)), "pr/evil.case.zst")
    assert str(e.value).startswith("pr/evil.case.zst: ")


@pytest.mark.parametrize("text, message", [
    (b'{"kfuzz": 1, "seed": NaN}', "NaN is not a JSON number"),
    (b'{"kfuzz":1,"target":"t","dtype":"float32","seed":1,"dims":{},"args":{"x":{"inject":[[1,1e400]]}}}',
     "special value inf is not finite"),
    (b'{"kfuzz": 1, "seed": ' + b"9" * 5000 + b"}", "not valid case JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid case JSON"),
    (b'{"x": [' + b",".join([b"[1,1]"] * 400_000) + b"]}", "JSON values"),
], ids=["nan", "long-int", "deep", "infinite", "many-values"])
def test_hostile_json_is_refused_not_raised(text, message):
    with pytest.raises(CaseError, match=message):
        decode(__import__("zstandard").ZstdCompressor().compress(text), "pr/evil.case.zst")


@pytest.mark.parametrize("payload, message", [
    ([1, 2], "must be an object"),
    ({"x": {"dtype": "float32", "shape": [4, 33]}}, "dtype, shape and data"),
    ({"x": {"dtype": "float32", "shape": [4.0, 33], "data": ""}}, "shape entry must be an integer"),
    ({"x": {"dtype": "float32", "shape": [-4, 33], "data": ""}}, "negative size"),
])
def test_malformed_payloads_are_refused(payload, message):
    with pytest.raises(CaseError, match=message):
        decode(_file(_doc(payload=payload)), "pr/evil.case.zst")


def test_cut_and_padded_frames_are_refused():
    data = encode(CASE)
    with pytest.raises(CaseError, match="cut short"):
        decode(data[:-3], "x.case.zst")
    with pytest.raises(CaseError, match=f"{len(data)} bytes after the frame"):
        decode(data + data, "x.case.zst")
    with pytest.raises(CaseError, match="not a valid zstd stream"):
        decode(data + b"abc", "x.case.zst")


def test_encode_refuses_what_decode_would_not_read(monkeypatch):
    monkeypatch.setenv("KFUZZ_MAX_CASE_FILE_BYTES", "100")
    with pytest.raises(CaseError, match="over the 100 bytes a case file may hold"):
        encode(CASE)


_BOMB_CHILD = """
import resource, sys, zstandard
from kfuzz.case import decode
from kfuzz.errors import CaseError
head = b'{"kfuzz":1,"target":"softmax","dtype":"float32","seed":1,"dims":{"N":1,"D":1},"record":"'
chunk = b" " * (1 << 24)
c = zstandard.ZstdCompressor(level=3).compressobj(size=len(head) + 64 * len(chunk) + 2)
data = c.compress(head) + b"".join(c.compress(chunk) for _ in range(64)) + c.compress(b'"}') + c.flush()
assert len(data) < 64 << 10 and zstandard.frame_content_size(data) > 1 << 30, len(data)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    decode(data, "bomb.case.zst")
    print("decoded")
except CaseError as e:
    print("refused", e)
print("grew_mb", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_a_zstd_bomb_is_refused_without_decompressing_it():
    """A 1 GiB frame of spaces in ~32 KiB (its size in the frame header) is cut at the
    64 MiB cap: the process grows by far less than the bomb (measured in a child)."""
    import os
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _BOMB_CHILD], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout
    assert "refused bomb.case.zst: decompresses to more than 64.0 MiB" in out, out
    assert int(out.split("grew_mb")[1]) < 200, out
