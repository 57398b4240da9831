"""llama.cpp's own DFlash beside treespec's methods on the same engine: one run, the same prompts.

llama.cpp runs DFlash drafters itself (``--spec-type draft-dflash``: a chain of one block per step).
This script builds its ``llama-speculative-simple`` tool from the llama.cpp source vendored in the
same llama-cpp-python release that treespec's engine runs on (``pip download --no-binary``; the
build trimmed to that tool), converts treespec's embedded DFlash drafter into llama.cpp's DFlash
GGUF with llama.cpp's own ``convert_hf_to_gguf.py``, and times, on the embedded default's Q4_1 file:

* llama.cpp: its DFlash chain (``--spec-draft-n-max`` = the drafter's block minus one), from the
  tool's own ``decoded N tokens in S seconds`` line (the tool has no AR mode; the AR row is the same
  library's, through the binding);
* treespec on llama.cpp: AR, the ``dflash`` chain, DDTree@16 and the cost-aware DominoTree@16.

The conversion: treespec's DFlash drafter drafts over a reduced vocabulary (8,192 rows of the
target's LM head, chosen by ``d2t``); llama.cpp's DFlash format has no field for one, so the
converted draft reads the target's full head (its argmax then ranges over every token).  That is
the nearest expression of the drafter there; its τ is printed beside treespec's.

    python benchmarks/llama_cpp_peer.py [--work DIR] [--tokens 128] [--prompts 2] [--threads N]

Needs a C++ toolchain and cmake (as llama-cpp-python's own build does) and ``sentencepiece`` for the
converter (``pip install sentencepiece``).  Run it with the machine otherwise idle.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from treespec.apps.assembly.embedded import cache_root, embedded_gguf, embedded_model_dir
from treespec.apps.assembly.loading import embedded_drafter_dir
from treespec.apps.assembly.methods import parse_method
from treespec.apps.assembly.session import Session
from treespec.pricing.conditions import ThreadControl

RELEASE = "llama-cpp-python==0.3.36"  # the binding treespec's engine runs (engines/llama_cpp.py REQUIREMENT)
PROMPTS = ("Explain how a binary search works, step by step.", "Write a short poem about the sea.",
           "What is 17 times 23? Think it through.", "Write a Python function that reverses a list.")
TREESPEC_METHODS = ("ar", "dflash", "ddtree@16", "cost-aware-dominotree@16")


def llama_source(work: Path) -> Path:
    """The llama.cpp source vendored in the release's sdist (downloaded once)."""
    source = work / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d",
                    str(work / "sdist"), RELEASE], check=True, capture_output=True)
    archive = next((work / "sdist").glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        tar.extractall(work / "sdist", members=members, filter="data")
    shutil.move(next((work / "sdist").glob("llama_cpp_python-*/vendor/llama.cpp")), source)
    return source


def build_tool(source: Path, work: Path, cores: int) -> Path:
    """``llama-speculative-simple``, built once, native kernels, nothing else."""
    tool = work / "build" / "bin" / "llama-speculative-simple"
    if tool.is_file():
        return tool
    flags = ["-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
             "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"]
    subprocess.run(["cmake", "-S", str(source), "-B", str(work / "build"), *flags], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(work / "build"), "--target", "llama-speculative-simple", "-j", str(cores)],
                   check=True, capture_output=True)
    return tool


def convert_drafter(source: Path, work: Path) -> Path:
    """treespec's DFlash drafter as llama.cpp's DFlash GGUF (the full vocabulary's head: module docstring)."""
    out = work / "dflash-draft.gguf"
    if out.is_file():
        return out
    folder = work / "dflash-hf"
    folder.mkdir(exist_ok=True)
    shipped = embedded_drafter_dir("dflash")
    config = json.loads((shipped / "config.json").read_text())
    config.pop("draft_vocab_size", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    from safetensors.torch import load_file, save_file

    weights = {k: v for k, v in load_file(shipped / "model.safetensors").items() if k != "d2t"}
    save_file(weights, folder / "model.safetensors")
    subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(folder), "--target-model-dir",
                    str(embedded_model_dir()), "--outtype", "f32", "--outfile", str(out)], check=True,
                   capture_output=True, env={"PYTHONPATH": str(source / "gguf-py"), "PATH": "/usr/bin:/bin"})
    return out


def llama_run(tool: Path, target: Path, draft: Path, prompt: str, tokens: int, threads: int, n_draft: int) -> dict:
    """One prompt through the tool: decoded tokens, seconds, and drafted / accepted counts."""
    done = subprocess.run([str(tool), "-m", str(target), "-md", str(draft), "--spec-type", "draft-dflash",
                           "--spec-draft-n-max", str(n_draft), "-p", prompt, "-n", str(tokens), "--temp", "0",
                           "--top-k", "1", "-t", str(threads), "-c", "4096"],
                          capture_output=True, text=True, check=False)
    log = done.stdout + done.stderr
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    if decoded is None:
        raise RuntimeError(f"llama-speculative-simple did not decode (exit {done.returncode}): {log[-600:]}")
    counts = {k: int(v) for k, v in re.findall(r"(n_drafted|n_accept)\s*=\s*(\d+)", log)}
    return {"tokens": int(decoded[1]), "seconds": float(decoded[2]), **counts}


def chat_text(session: Session, prompt: str) -> str:
    return session.tokenizer.decode(session.chat.encode([prompt]).tolist())


def treespec_rows(session: Session, prompts: list[str], tokens: int) -> dict[str, tuple[float, float]]:
    """Method -> (tokens per second, mean tau) over the prompts, on the engine."""
    rows = {}
    for method in TREESPEC_METHODS:
        decoder = session.decoder(parse_method(method))
        decoder.generate(session.chat.encode([prompts[0]]), max_new_tokens=8)  # warm-up
        made, seconds, taus = 0, 0.0, []
        for prompt in prompts:
            out = decoder.generate(session.chat.encode([prompt]), max_new_tokens=tokens, stop_token_ids=[])
            made, seconds, taus = made + out.stats.new_tokens, seconds + out.stats.decode_time, taus + out.stats.taus
        rows[method] = (made / seconds, sum(taus) / len(taus))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=cache_root() / "peer", help="where the source, build and draft go")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.tokens < 1 or args.prompts < 1:
        raise SystemExit(f"--tokens {args.tokens} --prompts {args.prompts}: give at least one of each")
    threads = ThreadControl.start(args.threads)
    count = threads.choice.threads
    print(f"threads: {threads.choice.describe()}", flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    source = llama_source(args.work)
    tool = build_tool(source, args.work, count)
    draft = convert_drafter(source, args.work)
    target = embedded_gguf()
    session = Session.load(None, {"dflash": embedded_drafter_dir("dflash"), "domino": embedded_drafter_dir("domino")},
                           engine="llama.cpp", threads=threads)
    prompts = list(PROMPTS[:args.prompts])
    block = json.loads((embedded_drafter_dir("dflash") / "config.json").read_text())["block_size"]
    print(f"{'system':<12}{'method':<40}{'tok/s':>8}{'tau':>7}")
    runs = [llama_run(tool, target, draft, chat_text(session, p), args.tokens, count, block - 1) for p in prompts]
    made, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
    rounds = sum(r.get("n_drafted", 0) for r in runs) / (block - 1)  # every round drafts a full block
    tau = 1 + sum(r.get("n_accept", 0) for r in runs) / max(1.0, rounds)
    print(f"{'llama.cpp':<12}{'its dflash chain':<40}{made / seconds:>8.1f}{tau:>7.2f}", flush=True)
    for method, (speed, tau) in treespec_rows(session, prompts, args.tokens).items():
        print(f"{'treespec':<12}{method + ' on llama.cpp':<40}{speed:>8.1f}{tau:>7.2f}", flush=True)
    session.close()


if __name__ == "__main__":
    main()
