"""What a checkpoint folder is, read from its files alone (no weights loaded): can pdserve serve it, and how.

`inspect_checkpoint(path)` is a pure function of the folder — architecture, per-layer attention,
KV shape, tokenizer fingerprint, supported or why not — for anything that must decide before a
model loads (the operator's admission checks, `pdserve up`, the workers). `layer_windows(config)`
is the per-layer attention the KV layout describes; the engine checks it against what the model's
attention is really handed (`hfmodel.HFPagedModel`). `resolve_dtype` turns `dtype: auto` into a
torch dtype for a device.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict

# files whose bytes decide which ids a text becomes (not tokenizer_config.json: its chat template does not)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt")
_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.gguf")
_LAYER_KINDS = {"full_attention", "sliding_attention"}


class UnsupportedModel(ValueError):
    """A checkpoint pdserve cannot serve; the message names the architecture and the missing piece."""


class ModelInfo(BaseModel):
    """A checkpoint as pdserve sees it. `supported` False comes with `reason` (what is missing, in words)."""

    model_config = ConfigDict(frozen=True)

    path: str
    architecture: str  # e.g. "Qwen2ForCausalLM" ("" when the config names none)
    model_type: str
    supported: bool
    reason: str | None = None
    num_layers: int = 0
    layer_windows: tuple[int, ...] = ()  # per layer: sliding window in tokens, 0 = full attention
    kv_heads: int = 0
    head_dim: int = 0
    vocab_size: int = 0
    max_context: int = 0
    dtype: str | None = None  # what the checkpoint's config says its weights are
    tokenizer_fingerprint: str | None = None  # equal for two checkpoints that turn text into the same ids


def inspect_checkpoint(path: str | Path) -> ModelInfo:
    """Describe the checkpoint folder at `path` from its config and tokenizer files (no weights are read)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        return ModelInfo(path=str(path), architecture="", model_type="", supported=False,
                         reason=f"no config.json in {path}: not a checkpoint folder")
    raw = json.loads(cfg_file.read_text())
    arch = (raw.get("architectures") or [""])[0]
    base = dict(path=str(path), architecture=arch, model_type=str(raw.get("model_type", "")),
                tokenizer_fingerprint=tokenizer_fingerprint(path),
                dtype=raw.get("dtype") or raw.get("torch_dtype"))
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path))
        check_supported(config, path)
        text = config.get_text_config()
        windows = layer_windows(text)
        heads = text.num_attention_heads
        return ModelInfo(**base, supported=True, num_layers=text.num_hidden_layers, layer_windows=windows,
                         kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                         head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
                         vocab_size=text.vocab_size, max_context=max_context(text))
    except UnsupportedModel as e:
        return ModelInfo(**base, supported=False, reason=str(e))
    except (ValueError, KeyError, OSError) as e:  # transformers cannot read the config
        return ModelInfo(**base, supported=False, reason=f"{arch or path.name}: transformers cannot read the config "
                                                          f"({type(e).__name__}: {e})")


def check_supported(config, path: Path | None = None) -> None:
    """Raise UnsupportedModel (naming the architecture and the missing piece) for what pdserve cannot serve:
    encoders, encoder-decoders, multimodal models, attention kinds other than full and sliding, no weights."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    named = getattr(config, "architectures", None)
    arch = named[0] if named else causal or type(config).__name__.removesuffix("Config")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{arch} is an encoder-decoder model; pdserve serves decoder-only causal language models")
    if config.get_text_config() is not config or any(hasattr(config, k) for k in ("vision_config", "audio_config")):
        raise UnsupportedModel(f"{arch} is multimodal (its config has a text config and more); pdserve serves "
                               "text-only decoder models")
    if causal is None or (named and not arch.endswith(("ForCausalLM", "LMHeadModel"))):
        raise UnsupportedModel(f"{arch} ({config.model_type}) is not a causal language model transformers can load "
                               "with AutoModelForCausalLM (an encoder, a classifier?); pdserve serves decoder-only "
                               "causal language models")
    layer_windows(config)  # attention kinds
    if path is not None and not any(any(Path(path).glob(p)) for p in _WEIGHTS):
        raise UnsupportedModel(f"{arch}: no weights in {path} (looked for {', '.join(_WEIGHTS)})")


def layer_windows(config) -> tuple[int, ...]:
    """Per decoder layer: its sliding window in tokens, or 0 for full attention (what `KVLayout` records).

    From `layer_types` where the config has them (Gemma, Qwen2/3, GPT-OSS: "sliding_attention" layers use
    `sliding_window`), else `sliding_window` on every layer when set (Mistral, Phi-3)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or 0
    types = getattr(config, "layer_types", None)
    if types:
        other = sorted(set(types) - _LAYER_KINDS)
        if other:
            arch = (getattr(config, "architectures", None) or [config.model_type])[0]
            raise UnsupportedModel(f"{arch} has {', '.join(other)} layers; pdserve's paged attention serves "
                                   "full and sliding-window attention layers")
        if len(types) != n:
            raise UnsupportedModel(f"{config.model_type}: {len(types)} layer_types for {n} layers")
        return tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    if window and getattr(config, "use_sliding_window", True):
        return (int(window),) * n
    return (0,) * n


def max_context(config) -> int:
    """The longest sequence the model's position embeddings cover, in tokens."""
    return int(getattr(config, "max_position_embeddings", None) or 2048)


def tokenizer_fingerprint(path: str | Path) -> str | None:
    """A short hash of the files that decide a text's token ids; None when the folder has none of them."""
    h = hashlib.sha256()
    found = False
    for name in _TOKENIZER_FILES:
        f = Path(path) / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
            found = True
    return h.hexdigest()[:16] if found else None


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX); without it bf16 is emulated."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f" {flag}" in flags for flag in ("avx512_bf16", "amx_bf16"))


def resolve_dtype(name: str, device: str = "cpu", config_dtype: str | None = None):
    """The torch dtype for the model and its KV: `name` ("float32", "bfloat16", "float16") as given, or for
    "auto" (as vLLM does) the checkpoint's half precision where the device runs it natively:

    * a GPU: bfloat16 where supported (compute capability 8+), else float16; a float16 checkpoint stays
      float16;
    * a CPU: bfloat16 only with native bf16 (AVX512-BF16 / AMX); else float32. Without it bf16 steps
      are emulated and slower here (SmolLM2, one thread: see bench/engine_families.py --dtypes).
    """
    import torch

    if name != "auto":
        try:
            return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
        except KeyError:
            raise ValueError(f"dtype {name!r}: expected auto, float32, bfloat16 or float16") from None
    dev = torch.device(device)
    if dev.type == "cuda":
        if config_dtype == "float16":
            return torch.float16
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dev.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return torch.float32
