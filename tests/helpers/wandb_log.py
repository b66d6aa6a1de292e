"""Reads an offline W&B run's history back from its ``.wandb`` file, the way ``wandb sync`` would upload it.

The file is W&B's record log: a 7-byte header (``:W&B``, a magic number, a version), then LevelDB's log format
(32 KiB blocks of records, each with a 7-byte header: CRC-32, length, kind; a record split across blocks comes as
first/middle/last parts), each record a ``wandb_internal_pb2.Record`` protobuf. wandb ships no reader of its own.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

_BLOCK = 32768
_FULL, _LAST = 1, 4


def _records(data: bytes) -> Iterator[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a W&B record log")
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (_FULL, _LAST):
            yield parts
            parts = b""


def read_history(run_file: Path) -> list[dict[str, object]]:
    """Each ``wandb.log`` row of the run, in order, keys joined with ``/`` when nested."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for raw in _records(run_file.read_bytes()):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
