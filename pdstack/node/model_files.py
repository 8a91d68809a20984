"""Phase `model`: the release's model files from the datacenter's bucket onto the node's disk, every one checked.

Files download in parallel (a bounded pool), each into `.<name>.part` beside its place, resumed with a ranged GET
when a part is already there (a reboot during the download), hashed as it arrives, and renamed into place only when
its size and sha256 are the manifest's. A file whose bytes are wrong is retried once from the start, then fails the
phase with its part removed: nothing unverified is ever at a model path. A file already in place is hashed and kept
when it matches; `.pdstack-verified.json` remembers (size, mtime) of what was verified, so a second boot of the same
release neither downloads nor re-hashes anything. Bytes downloaded are counted (the metric and the report).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdstack.node.files import write_atomic
from pdstack.node.loader import CHUNK, BootstrapError, Phase, file_sha256
from pdstack.node.release import ModelFile, ModelRelease

VERIFIED = ".pdstack-verified.json"
PARALLEL = 8


@dataclass(frozen=True)
class ModelSync:
    files: int
    downloaded_files: int
    downloaded_bytes: int
    total_bytes: int


class _Counter:
    def __init__(self) -> None:
        self.bytes = 0
        self.files = 0
        self._lock = threading.Lock()

    def add(self, count: int) -> None:
        with self._lock:
            self.bytes += count

    def file(self) -> None:
        with self._lock:
            self.files += 1


def _part(target: Path) -> Path:
    return target.with_name(f".{target.name}.part")


def _download(s3: Any, bucket: str, key: str, part: Path, *, size: int, counter: _Counter) -> str:
    """Complete `part` from the object's bytes (resuming at its length); the sha256 of the whole part."""
    digest = hashlib.sha256()
    have = part.stat().st_size if part.exists() else 0
    if have > size:
        part.unlink()
        have = 0
    if have:
        with part.open("rb") as old:
            while block := old.read(CHUNK):
                digest.update(block)
    if have < size or size == 0:
        ranged = {"Range": f"bytes={have}-"} if have else {}
        body = s3.get_object(Bucket=bucket, Key=key, **ranged)["Body"]
        with part.open("ab") as out:
            for block in body.iter_chunks(CHUNK):
                out.write(block)
                digest.update(block)
                counter.add(len(block))
            out.flush()
            os.fsync(out.fileno())
    return digest.hexdigest()


def _fetch(s3: Any, bucket: str, model: ModelRelease, file: ModelFile, *, target: Path, counter: _Counter) -> None:
    key = model.key(file)
    part = _part(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        for attempt in range(2):
            got = _download(s3, bucket, key, part, size=file.size, counter=counter)
            size = part.stat().st_size
            if size == file.size and got == file.sha256:
                os.chmod(part, 0o644)
                os.replace(part, target)
                counter.file()
                return
            part.unlink()
            if attempt == 1:
                raise BootstrapError(
                    Phase.MODEL,
                    f"s3://{bucket}/{key}: {size} bytes with sha256 {got}, the manifest says {file.size} bytes "
                    f"with sha256 {file.sha256}",
                )
    except BootstrapError:
        raise
    except Exception as exc:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code", type(exc).__name__)
        raise BootstrapError(Phase.MODEL, f"cannot download s3://{bucket}/{key}: {code}") from None


def _verified(model_dir: Path) -> dict[str, Any]:
    try:
        files = json.loads((model_dir / VERIFIED).read_text(encoding="utf-8"))["files"]
        return dict(files) if isinstance(files, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _stamp(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def _in_place(target: Path, file: ModelFile, verified: dict[str, Any]) -> bool:
    """The file at its place is the manifest's: verified before and unchanged since, or hashed now."""
    if not target.is_file() or target.stat().st_size != file.size:
        return False
    known = verified.get(file.path)
    if isinstance(known, dict) and known.get("sha256") == file.sha256 and known.get("stamp") == _stamp(target):
        return True
    return file_sha256(target) == file.sha256


def sync_model(s3: Any, bucket: str, model: ModelRelease, model_dir: Path, parallel: int = PARALLEL) -> ModelSync:
    model_dir.mkdir(parents=True, exist_ok=True)
    verified = _verified(model_dir)
    missing = [f for f in model.files if not _in_place(model_dir / f.path, f, verified)]
    counter = _Counter()
    if missing:
        with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(missing)))) as pool:
            futures = [
                pool.submit(_fetch, s3, bucket, model, f, target=model_dir / f.path, counter=counter) for f in missing
            ]
            errors = [exc for exc in (fut.exception() for fut in futures) if exc is not None]
        if errors:
            raise errors[0]
    record = {
        "model": {"name": model.name, "revision": model.revision},
        "files": {f.path: {"sha256": f.sha256, "stamp": _stamp(model_dir / f.path)} for f in model.files},
    }
    write_atomic(model_dir / VERIFIED, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
    return ModelSync(len(model.files), counter.files, counter.bytes, model.size)
