"""Checkpoint checksums: XXH3-64 for new files, CRC-32 for old ones, verified while the
next chunk is read."""

from __future__ import annotations

import zlib

import pytest
import torch
import xxhash

from fzero.checkpoint import CheckpointError, _files
from fzero.checkpoint._checksum import digest, digest_bytes, new_hasher
from fzero.checkpoint._files import SafetensorsFile, tensor_bytes, write_safetensors


def test_digests_are_the_packages_own():
    data = bytes(range(256)) * 1000
    assert digest(data, "xxh3_64") == xxhash.xxh3_64_intdigest(data)
    assert digest(data, "crc32") == zlib.crc32(data)
    for algorithm in ("xxh3_64", "crc32"):
        hasher = new_hasher(algorithm, data[:10])
        hasher.update(data[10:5000])
        hasher.update(memoryview(data)[5000:])
        assert hasher.intdigest() == digest(data, algorithm)
    assert len(digest_bytes(1, "xxh3_64")) == 8 and len(digest_bytes(1, "crc32")) == 4
    with pytest.raises(ValueError, match=r"'md5' is unknown; allowed: \('xxh3_64', 'crc32'\)"):
        digest(data, "md5")


def test_a_tensor_read_in_chunks_verifies_and_a_flipped_byte_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(_files, "_CHUNK", 4096)  # 10 chunks per tensor
    tensor = torch.arange(10 * 1024, dtype=torch.float32)
    path = str(tmp_path / "t.safetensors")
    written = write_safetensors(path, [("w", tensor)])
    assert written.algorithm == "xxh3_64"
    assert written.tensor_digests["w"] == xxhash.xxh3_64_intdigest(tensor_bytes(tensor))
    out = torch.empty_like(tensor)
    with SafetensorsFile(path, written.size) as f:
        f.read_into("w", out, written.tensor_digests["w"])
    assert torch.equal(out, tensor)
    data = bytearray((tmp_path / "t.safetensors").read_bytes())
    data[-5000] ^= 1  # in a middle chunk
    (tmp_path / "t.safetensors").write_bytes(bytes(data))
    damaged = r"tensor 'w' in .*t.safetensors fails its xxh3_64 check"
    with SafetensorsFile(path, written.size) as f, pytest.raises(CheckpointError, match=damaged):
        f.read_into("w", out, written.tensor_digests["w"])


def test_a_tensor_written_in_parts_is_the_whole_tensors_bytes_and_reads_by_span(tmp_path):
    """`Chunks`: the parts of a tensor (a unit's sub-group pieces) written and hashed as
    they come give the file and digests of the whole tensor; `read_span` reads any range
    of it back; parts that do not add up to the header are refused by name."""
    from fzero.checkpoint._files import Chunks, write_safetensors_stream

    tensor = torch.randn(5000, generator=torch.Generator().manual_seed(0)).bfloat16()
    other = torch.arange(7, dtype=torch.float32)
    whole = write_safetensors(str(tmp_path / "whole.safetensors"), [("a", tensor), ("b", other)])
    specs = [("a", torch.bfloat16, (5000,)), ("b", torch.float32, (7,))]
    parts = Chunks(tensor[a : a + 2048] for a in range(0, 5000, 2048))
    path = str(tmp_path / "parts.safetensors")
    written = write_safetensors_stream(path, specs, [parts, other])
    assert (tmp_path / "parts.safetensors").read_bytes() == (
        tmp_path / "whole.safetensors"
    ).read_bytes()
    assert written.tensor_digests == whole.tensor_digests
    assert written.checksum == whole.checksum
    out = torch.empty(1001, dtype=torch.bfloat16)
    with SafetensorsFile(path, written.size) as f:
        f.read_span("a", 3000, out)
        assert torch.equal(out, tensor[3000:4001])
        with pytest.raises(CheckpointError, match=r"tensor 'a' .*elements \[4500, 5501\)"):
            f.read_span("a", 4500, out)
    short = Chunks(iter([tensor[:4000]]))
    with pytest.raises(ValueError, match=r"tensor 'a': parts of 4000 elements; .*\(5000,\)"):
        write_safetensors_stream(path, specs, [short, other])
    wrong = Chunks(iter([tensor.float()]))
    with pytest.raises(ValueError, match=r"tensor 'a': a part of torch.float32 5000 elements"):
        write_safetensors_stream(path, specs, [wrong, other])
