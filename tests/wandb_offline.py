"""Test helpers for offline Weights & Biases runs: no network, and what a run received read back.

An offline run's `.wandb` file is W&B's transaction log: LevelDB log framing around wandb's own
protobuf `Record`s (`wandb.proto.wandb_internal_pb2`), which `wandb sync` uploads later.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path


def offline_wandb_env(monkeypatch, home: Path) -> None:
    """W&B offline whatever a config says, its settings and caches under `home`, and no API key."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def wandb_records(path: Path) -> list:
    """The protobuf records of one `.wandb` file: a 7-byte header, then 32 KiB blocks of chunks
    (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def offline_runs(run_dir: Path) -> list[Path]:
    """The `.wandb` files of `run_dir`'s offline W&B runs, oldest first, complete: `finish()` returns
    before W&B's service process has written a run's file out, `wandb.teardown()` waits for it."""
    import wandb

    wandb.teardown()
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def history(records: list) -> list[dict]:
    """The logged rows, W&B's own keys (_step, _runtime, _timestamp) left out."""
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in r.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def config_updates(records: list) -> dict:
    return {item.key: json.loads(item.value_json) for r in records if r.WhichOneof("record_type") == "config"
            for item in r.config.update if item.key != "_wandb"}
