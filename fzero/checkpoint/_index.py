"""The checkpoint index: one msgpack record per tag, checksummed; and the caller's
`client_state`, encoded as msgpack (never pickled).

Index schema (`index.msgpack`, a msgpack map `{"fzero_checkpoint": 1, "body":
bytes, "crc32": int}` whose body is the map below; the index itself is checked with
CRC-32):

- `tag`, `fzero_version`, `world_size`, `stage`, `precision`, `plan` (the
  plan's own msgpack bytes, `fzero.partition.to_bytes`);
- `counters`: global_steps, global_samples, micro_steps, skipped_steps, lr_steps;
- `batch`: train_batch_size, micro_batch_size, gradient_accumulation_steps;
  `mid_accumulation` (gradient accumulators are saved when true);
- `config` (the resolved config), `optimizer` (name, hyper-parameters per unit
  group, scalar state such as `step`), `scheduler`, `loss_scale`;
- `tensors`: the model's `state_dict` keys in order, each with shape, dtype and
  where it comes from (a trainable tensor by fqn, or a module tensor);
- `ranks`: per rank of the plan its file, byte size, checksum, saved slices (key, kind,
  fqn, element range, and the tensor's digest in the field `crc`: XXH3-64, or CRC-32 in
  indexes written before `checksum_algorithm` was recorded, as that key says) and RNG
  states (torch, Python `random`, NumPy);
- for a plan on a mesh with replicas (`partition.OnMesh`; only the first replica of
  each rank writes its file): `processes` and `process_rng`, every process's RNG
  states in process order (each draws its own data);
- `files`: other files (client tensors) with size and checksum;
- `client_state`.
"""

from __future__ import annotations

import zlib
from typing import Any

import msgpack
import torch

from fzero.checkpoint._files import CheckpointError

__all__ = ["FORMAT_VERSION", "decode_client_state", "encode_client_state", "pack", "unpack"]

FORMAT_VERSION = 1
_TENSOR_REF = "__fzero_tensor__"
_TUPLE = "__fzero_tuple__"  # msgpack has one array type: a tuple is marked, a list is not


def pack(body: dict[str, Any]) -> bytes:
    """The index bytes: the msgpack body wrapped with its CRC-32."""
    data = msgpack.packb(body, use_bin_type=True)
    return msgpack.packb(
        {"fzero_checkpoint": FORMAT_VERSION, "body": data, "crc32": zlib.crc32(data)},
        use_bin_type=True,
    )


def unpack(raw: bytes, path: str) -> dict[str, Any]:
    """Decode and verify index bytes read from `path`; anything else is refused."""
    try:
        outer = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        version, data, crc = outer["fzero_checkpoint"], outer["body"], outer["crc32"]
    except Exception as error:  # msgpack raises several types for garbage
        raise CheckpointError(
            f"{path} is damaged or not an fzero checkpoint index ({type(error).__name__}); "
            "fzero reads msgpack, never pickle"
        ) from None
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has index format {version}; this fzero reads {FORMAT_VERSION}"
        )
    if zlib.crc32(data) != crc:
        raise CheckpointError(f"{path} fails its CRC-32 check: the index is damaged")
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def encode_client_state(value: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """`value` as msgpack-able data; tensors move to `tensors` and leave a reference.

    Allowed: None, bool, int, float, str, bytes, lists, tuples (read back as tuples,
    as a pickled client_state is), dicts with str keys, tensors.
    """
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    if isinstance(value, torch.Tensor):
        key = path or "<root>"
        tensors[key] = value.detach().cpu().contiguous()
        return {_TENSOR_REF: key}
    if isinstance(value, list | tuple):
        items = [encode_client_state(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]
        return {_TUPLE: items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(
                    f"client_state key {path}{k!r} is {type(k).__name__}; keys must be str"
                )
            out[k] = encode_client_state(v, tensors, f"{path}.{k}" if path else k)
        return out
    raise TypeError(
        f"client_state{'.' + path if path else ''} is {type(value).__name__}; allowed: None, "
        "bool, int, float, str, bytes, list, tuple, dict with str keys, torch.Tensor"
    )


def decode_client_state(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [decode_client_state(v, tensors) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TENSOR_REF}:
            return tensors[value[_TENSOR_REF]]
        if set(value) == {_TUPLE}:
            return tuple(decode_client_state(v, tensors) for v in value[_TUPLE])
        return {k: decode_client_state(v, tensors) for k, v in value.items()}
    return value
