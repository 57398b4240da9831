"""``treespec data-store``: keep a data pass's shards in the repository, or lay them out again.

``treespec data-store save --data runs/data/greedy --store drafters/embedded/data/greedy`` copies
the pass's new shards into the store (xz-compressed, with a manifest naming the target and the
tokenizer); ``treespec data-store restore --store ... --data ...`` writes them back byte for byte,
so the pass resumes and the teacher cache is rebuilt from the same answers
(`treespec.apps.data.datastore`).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("save", "restore"), help="save: run directory -> store; restore: back")
    parser.add_argument("--data", type=Path, required=True, help="the pass's run directory of shard-*.safetensors")
    parser.add_argument("--store", type=Path, required=True,
                        help="the committed store directory of the pass; for restore, also the name of a pass "
                             "installed with treespec (greedy, t07, ...: the embedded drafters' training data)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="the target the data was made with, for its tokenizer (default: the embedded SmolLM2)")


def _tokenizer(model_dir: Path | None) -> str:
    from transformers import AutoTokenizer

    from treespec.apps.assembly.embedded import embedded_model_dir
    from treespec.apps.data.datastore import tokenizer_identity

    path = model_dir or embedded_model_dir()
    try:
        return tokenizer_identity(AutoTokenizer.from_pretrained(path, local_files_only=True))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"treespec data-store: no usable tokenizer at {path} ({str(exc).splitlines()[0]})") from None


def run(args: argparse.Namespace) -> int:
    from treespec.apps.data.datastore import StoreError, restore_store, save_store, shipped_store

    try:
        if args.action == "save":
            names = save_store(args.data, args.store, tokenizer=_tokenizer(args.model_dir))
            print(f"{len(names)} shard(s) saved to {args.store}")
        else:
            names = restore_store(shipped_store(args.store), args.data)
            print(f"{len(names)} shard(s) restored to {args.data}")
    except StoreError as exc:
        raise SystemExit(f"treespec data-store: {exc}") from None
    return 0
