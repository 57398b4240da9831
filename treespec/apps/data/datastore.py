"""The committed store of self-distillation data: data shards kept, compressed, in the repository.

Contract
--------
A data pass (`treespec.apps.data.selfdistill`) writes ``shard-NNNNN.safetensors`` files to an ignored
run directory, which does not outlive a session.  `save_store(data_dir, store_dir)` copies every
shard of a pass into a store directory meant to be committed: each shard as
``shard-NNNNN.safetensors.xz`` (the shard's exact bytes, xz-compressed: about a fifth of their size)
and one ``manifest.json``:

    {"format": 1, "target": <the shards' ``model`` metadata: name and sha256 of the weights>,
     "tokenizer": <sha256 of the tokenizer's vocabulary>, "config": <the pass's DistillConfig JSON>,
     "dtype": <the target dtype the answers were made in>,
     "shards": {"shard-00000": {"sha256": <of the uncompressed shard>, "rows": n, "prompts": [ids],
                                "response_tokens": t}, ...}}

`restore_store(store_dir, data_dir)` writes the shards back, byte for byte (checked against the
manifest's sha256), so the pass resumes where the store ends and a teacher cache built from them
is the one built from the original run.  Restoring never replaces a shard the run directory
already holds (a local pass that has gone further is newer); saving replaces a stored shard that
the pass rewrote (the short last shard of a run that was later extended).  Every file is written to
a temporary name and renamed.  No pickles: shards are safetensors, the manifest JSON.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import lzma
import os
from pathlib import Path

from safetensors.torch import load

__all__ = ["FORMAT", "StoreError", "read_manifest", "shipped_store", "shipped_stores", "restore_store", "save_store", "shard_metadata", "stored_shard",
           "tokenizer_identity"]

FORMAT = 1
MANIFEST = "manifest.json"
_SUFFIX = ".safetensors.xz"


class StoreError(ValueError):
    """A store that cannot be read or written as asked (the message names the file and the problem)."""


def _shipped_root() -> Path:
    """The installed folder of the data passes (package data of ``treespec.drafters``)."""
    return Path(str(importlib.resources.files("treespec.drafters"))) / "embedded" / "data"


def shipped_stores() -> list[str]:
    """Names of the data passes installed with treespec (``treespec/drafters/embedded/data/NAME``):
    the embedded drafters' training answers."""
    root = _shipped_root()
    return sorted(p.name for p in root.iterdir() if (p / "manifest.json").is_file()) if root.is_dir() else []


def shipped_store(store: Path) -> Path:
    """``store`` itself when it is a folder or a path; a bare name of a shipped pass (`shipped_stores`)
    becomes that pass's installed folder."""
    if store.exists() or len(store.parts) != 1 or str(store) not in shipped_stores():
        return store
    return _shipped_root() / str(store)


def tokenizer_identity(tokenizer) -> str:
    """sha256 of a tokenizer's vocabulary (token -> id, keys sorted): what the stored ids mean."""
    vocab = json.dumps(tokenizer.get_vocab(), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(vocab.encode()).hexdigest()


def read_manifest(store_dir: Path) -> dict:
    """The store's manifest; `StoreError` when there is none or it is not this format."""
    path = Path(store_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise StoreError(f"no data store at {store_dir} ({MANIFEST} missing)") from None
    except json.JSONDecodeError as exc:
        raise StoreError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if manifest.get("format") != FORMAT:
        raise StoreError(f"{path}: store format {manifest.get('format')!r}, expected {FORMAT}")
    return manifest


def shard_metadata(data: bytes) -> dict[str, str]:
    """The string metadata in a safetensors file's header, read from its bytes."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + size]).get("__metadata__", {})


def _shard_facts(data: bytes) -> tuple[dict[str, str], dict]:
    """(safetensors metadata, manifest entry) of one data shard's bytes."""
    meta, tensors = shard_metadata(data), load(data)
    offsets, starts = tensors["offsets"], tensors["response_start"]
    rows = json.loads(meta.get("rows", meta["ids"]))
    response = int((offsets[1:] - offsets[:-1] - starts).sum())
    entry = {"sha256": hashlib.sha256(data).hexdigest(), "rows": len(rows), "prompts": rows,
             "response_tokens": response}
    return meta, entry


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def save_store(data_dir: Path, store_dir: Path, *, tokenizer: str) -> list[str]:
    """Copy the shards of ``data_dir`` that the store lacks or holds in another version into
    ``store_dir``; returns the names written.  ``tokenizer``: `tokenizer_identity` of the target's.

    Refused when the shards come from different targets or settings, or from other ones than the
    store's: one store holds one pass."""
    data_dir, store_dir = Path(data_dir), Path(store_dir)
    paths = sorted(data_dir.glob("shard-*.safetensors"))
    if not paths:
        raise StoreError(f"no data shards (shard-*.safetensors) in {data_dir}")
    manifest = read_manifest(store_dir) if (store_dir / MANIFEST).exists() else None
    written = []
    for path in paths:
        data = path.read_bytes()
        meta, entry = _shard_facts(data)
        head = {"target": meta.get("model"), "tokenizer": tokenizer, "config": json.loads(meta["config"]),
                "dtype": meta.get("dtype")}
        if manifest is None:
            manifest = {"format": FORMAT, **head, "shards": {}}
        differ = [k for k, v in head.items() if manifest[k] != v]
        if differ:
            raise StoreError(f"{path} differs from the store {store_dir} in {', '.join(differ)}: "
                             "a store holds one pass of one target")
        name = path.name.removesuffix(".safetensors")
        if manifest["shards"].get(name, {}).get("sha256") == entry["sha256"]:
            continue
        store_dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(store_dir / (name + _SUFFIX), lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
        manifest["shards"][name] = entry
        written.append(name)
    if written:
        manifest["shards"] = dict(sorted(manifest["shards"].items()))
        _write_atomic(store_dir / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return written


def stored_shard(store_dir: Path, name: str, entry: dict) -> bytes:
    """The exact bytes of one stored shard, checked against its manifest entry."""
    path = Path(store_dir) / (name + _SUFFIX)
    try:
        data = lzma.decompress(path.read_bytes())
    except FileNotFoundError:
        raise StoreError(f"{path}: listed in the manifest but missing") from None
    except lzma.LZMAError as exc:
        raise StoreError(f"{path}: not a valid xz file ({exc})") from None
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise StoreError(f"{path}: its content does not match the manifest's sha256")
    return data


def restore_store(store_dir: Path, data_dir: Path) -> list[str]:
    """Write every stored shard that ``data_dir`` lacks; returns the names written (see the module
    docstring: shards already present are kept)."""
    manifest = read_manifest(store_dir)
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, entry in manifest["shards"].items():
        target = data_dir / f"{name}.safetensors"
        if target.exists():
            continue
        _write_atomic(target, stored_shard(store_dir, name, entry))
        written.append(name)
    return written
