"""The model runtime both workers share: load a causal LM from a local folder, run it with an explicit KV cache.

Prefill turns a prompt into (last-position logits, KV); decode continues from a KV it was
handed. The KV leaves and enters the runtime as `KVBlocks` (fixed tokens per block, with a
`KVLayout`), which is what the channel moves and what later paging and prefix caching build on.
"""
from __future__ import annotations

import inspect
import logging
import threading
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationConfig

from pdserve.basetypes import DEFAULT_BLOCK_SIZE, KVLayout, dtype_name
from pdserve.checkpoint import check_supported, layer_windows, max_context
from pdserve.kvtransfer.layout import KVBlocks
from pdserve.modelstore import model_fingerprint

log = logging.getLogger("pdserve.runtime")


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Crop a transformers ``DynamicCache`` to its first ``length`` positions.

    Uses the negative ("remove this many") form, which transformers 5.24 requires (it refuses
    a positive length) and older versions also take; never calls ``crop(0)``, which older
    versions read as "crop to length 0".
    """
    remove = cache.get_seq_length() - length
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} positions to {length}")
    if remove:
        cache.crop(-remove)


class ModelRunner:
    """One model on one device. Not thread-safe: call it from one compute thread.

    The tokenizer, config, KV layout and stop tokens are read at once; the `transformers` weights
    load on first use of `model` — a worker that computes with the paged engine never loads them.
    A checkpoint pdserve cannot serve is refused here (`pdserve.checkpoint.UnsupportedModel`).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        block_size: int = DEFAULT_BLOCK_SIZE,
        served_name: str | None = None,
    ):
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        cfg = AutoConfig.from_pretrained(self.model_dir)
        check_supported(cfg, self.model_dir)  # before anything loads: a clear refusal, not a stack trace later
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.config = cfg
        self.name = served_name or self.model_dir.name
        text = cfg.get_text_config()
        self.max_context = max_context(text)
        self.vocab_size = int(text.vocab_size)
        heads = text.num_attention_heads
        self.layout = KVLayout(
            model_fingerprint=model_fingerprint(self.model_dir),
            num_layers=text.num_hidden_layers,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            dtype=dtype_name(dtype),
            block_size=block_size,
            layer_windows=layer_windows(text),
        )
        try:
            eos = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
        except OSError:  # no generation_config.json: the model config's
            eos = getattr(cfg, "eos_token_id", None)
        self.eos_token_ids: set[int] = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._model = None
        self._cache_kw = "cache"
        self.lock = threading.Lock()

    @property
    def model(self):
        """The `transformers` model, loaded on first use."""
        if self._model is None:
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype).to(self.device).eval()
            # transformers 5.24 renamed `past_key_values` to `cache` (the old name goes in 5.40);
            # the GPU machines run 5.17, which only has the old one.
            params = inspect.signature(model.forward).parameters
            self._cache_kw = "cache" if "cache" in params else "past_key_values"
            self._model = model
        return self._model

    # -- forward passes -------------------------------------------------------------------

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    @torch.inference_mode()
    def forward(self, token_ids: list[int] | torch.Tensor, cache: DynamicCache, last_only: bool = True) -> torch.Tensor:
        """Run `token_ids` after what `cache` holds. Returns logits `[n, vocab]` (n = 1 if last_only) as fp32."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).view(1, -1)
        out = self.model(
            input_ids=ids, use_cache=True, logits_to_keep=1 if last_only else 0, **{self._cache_kw: cache}
        )
        return out.logits[0].float()

    def prefill(self, token_ids: list[int]) -> tuple[torch.Tensor, DynamicCache]:
        """Prompt → (logits of the last position `[vocab]`, KV cache holding the whole prompt)."""
        cache = self.new_cache()
        logits = self.forward(token_ids, cache)
        return logits[-1], cache

    # -- KV in and out as blocks -----------------------------------------------------------

    def cache_to_blocks(self, cache: DynamicCache) -> KVBlocks:
        n = cache.get_seq_length()
        layers = [
            KVBlocks.layer_from_dense(layer.keys[0], layer.values[0], self.layout.block_size) for layer in cache.layers
        ]
        return KVBlocks(self.layout, n, layers)

    def blocks_to_cache(self, kv: KVBlocks) -> DynamicCache:
        self.layout.check_matches(kv.layout)
        if len(kv.layers) != self.layout.num_layers:
            raise ValueError(f"KV has {len(kv.layers)} layers, model has {self.layout.num_layers}")
        cache = self.new_cache()
        for i, blocks in enumerate(kv.layers):
            k, v = KVBlocks.layer_to_dense(blocks.to(self.device), kv.num_tokens)
            cache.update(k.unsqueeze(0).contiguous(), v.unsqueeze(0).contiguous(), layer_idx=i)
        return cache

    # -- text ------------------------------------------------------------------------------

    def encode_chat(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
