"""What KV compression on the wire costs: bytes saved, and accuracy of the model that continues from it.

The quantiser is `kernels.kv_quant` (int8 / fp8, one float32 scale per (token, K/V, head), see
`kvtransfer.frames.to_token_groups`), followed on the wire by a lossless deflate of the quantised bytes;
this module only runs KV through exactly the path a transfer takes (`layer_wire_pieces` on the sender,
`Assembly` on the receiver) and measures bytes on the wire, greedy agreement and perplexity against
uncompressed KV.
"""
from __future__ import annotations

import math

import torch

from pdserve.basetypes import KVLayout
from pdserve.kvtransfer.layout import KVBlocks
from pdserve.kvtransfer.frames import TransferHeader, layer_wire_pieces
from pdserve.kvtransfer.receiver import Assembly


def wire_bytes(layout: KVLayout, num_tokens: int, compression: str) -> int:
    """Bytes of a transfer of `num_tokens` before the lossless pass (payload + scales; frame headers excluded).

    For int8/fp8 this is an upper bound: the deflate pass depends on the values, so the real count is
    only known by sending real KV (`wire_round_trip`, `wire_ratios`).
    """
    if compression == "none":
        return layout.payload_bytes(num_tokens)
    from pdserve.kernels.kv_quant import payload_bytes

    # one quantisation group per (token, K/V, head): see kvtransfer.frames.to_token_groups
    return sum(payload_bytes(layout.layer_blocks(i, num_tokens) * layout.block_size, layout.kv_heads, 1,
                             layout.head_dim) for i in range(layout.num_layers))


def wire_round_trip(kv: KVBlocks, compression: str) -> tuple[KVBlocks, int]:
    """`kv` as the receiver would rebuild it after a transfer with `compression` → (KVBlocks, wire bytes)."""
    header = TransferHeader(transfer_token="local", request_id="local", sender_id="local", sender_generation=0,
                            layout=kv.layout, num_tokens=kv.num_tokens, num_chunks=len(kv.layers),
                            total_bytes=kv.layout.payload_bytes(kv.num_tokens), compression=compression)
    asm = Assembly(kv.layout, header)
    for i, layer in enumerate(kv.layers):
        for kind, li, off, payload in layer_wire_pieces(i, layer, compression):
            asm.accept(kind, li, off, payload)
    out, stats = asm.finish()
    return out, stats["wire_bytes"]


@torch.inference_mode()
def wire_ratios(runner, texts: list[list[int]], compression: str = "int8",
                dtypes: tuple[str, ...] = ("bfloat16", "float32")) -> dict[str, float]:
    """Uncompressed bytes / bytes on the wire with `compression`, on the real KV of `runner`'s model.

    Each text is prefilled; its KV, cast to each of `dtypes`, goes through `wire_round_trip`. Returns
    {dtype: ratio} over all texts together (the int8 payload is one byte per value whatever the dtype,
    so the ratio vs fp32 is about twice the ratio vs bf16).
    """
    raw = dict.fromkeys(dtypes, 0)
    wire = dict.fromkeys(dtypes, 0)
    for ids in texts:
        _, cache = runner.prefill(ids)
        kv = runner.cache_to_blocks(cache)
        for name in dtypes:
            layout = kv.layout.model_copy(update={"dtype": name})
            cast = KVBlocks(layout, kv.num_tokens, [t.to(layout.torch_dtype) for t in kv.layers])
            raw[name] += cast.nbytes
            wire[name] += wire_round_trip(cast, compression)[1]
    return {name: raw[name] / wire[name] for name in dtypes}


@torch.inference_mode()
def compression_accuracy(runner, texts: list[list[int]], compression: str, context_fraction: float = 0.5,
                         free_run_tokens: int = 0) -> dict:
    """Next-token accuracy of a model continuing from KV sent with `compression`, against exact KV.

    Each text is split: the first `context_fraction` of its tokens is prefilled (that KV crosses the
    wire), the rest is scored teacher-forced on top of the exact and of the round-tripped KV. At every
    scored position the greedy (argmax) token from both is compared. Perplexities are of the real
    text. With `free_run_tokens`, also greedy-decodes that many tokens from both KVs and reports where
    the compressed run first leaves the exact one (None: identical).
    Returns {positions, agree, agreement, ppl_exact, ppl_compressed, ppl_change, wire_ratio, ...}.
    """
    agree = positions = 0
    nll_exact = nll_comp = 0.0
    diverged: list[int | None] = []
    margins: list[float] = []  # exact run's top-1 minus top-2 log-prob where the argmaxes differ
    bytes_raw = bytes_wire = 0
    for ids in texts:
        cut = max(1, int(len(ids) * context_fraction))
        ctx, rest = ids[:cut], ids[cut:]
        logits, cache = runner.prefill(ctx)
        kv = runner.cache_to_blocks(cache)
        kv_c, wb = wire_round_trip(kv, compression)
        bytes_raw += kv.nbytes
        bytes_wire += wb
        # position j of `rest` is predicted by the logits before it: prefill's last, then rest[:-1]
        lp_e = torch.log_softmax(torch.cat([logits[None], runner.forward(rest[:-1], runner.blocks_to_cache(kv),
                                                                         last_only=False)]), -1)
        lp_c = torch.log_softmax(torch.cat([logits[None], runner.forward(rest[:-1], runner.blocks_to_cache(kv_c),
                                                                         last_only=False)]), -1)
        # the first prediction comes from prefill itself (no KV crossed yet): score only the rest
        lp_e, lp_c, targets = lp_e[1:], lp_c[1:], torch.tensor(rest[1:])
        same = lp_e.argmax(-1) == lp_c.argmax(-1)
        agree += int(same.sum())
        top2 = lp_e[~same].topk(2, dim=-1).values
        margins += [float(m) for m in (top2[:, 0] - top2[:, 1])]
        positions += len(targets)
        nll_exact -= float(lp_e.gather(1, targets[:, None]).sum())
        nll_comp -= float(lp_c.gather(1, targets[:, None]).sum())
        if free_run_tokens:
            first = int(torch.argmax(logits))
            runs = []
            for k in (kv, kv_c):
                c, tok, out = runner.blocks_to_cache(k), first, []
                for _ in range(free_run_tokens):
                    tok = int(torch.argmax(runner.forward([tok], c)[-1]))
                    out.append(tok)
                runs.append(out)
            diverged.append(next((j for j, (a, b) in enumerate(zip(*runs)) if a != b), None))
    ppl_e, ppl_c = math.exp(nll_exact / positions), math.exp(nll_comp / positions)
    return {"compression": compression, "texts": len(texts), "positions": positions, "agree": agree,
            "agreement": agree / positions, "ppl_exact": ppl_e, "ppl_compressed": ppl_c,
            "ppl_change": ppl_c / ppl_e - 1.0, "first_divergence": diverged, "wire_ratio": bytes_raw / bytes_wire,
            "disagreement_margins": sorted(margins)}


# Varied real text (prose, code, facts, dialogue, lists, markup, numbers), scored after a split.
VARIED_TEXTS = [
    "The Eiffel Tower was built between 1887 and 1889 as the entrance arch for the 1889 World's Fair in Paris. "
    "At first it was criticised by some of France's leading artists and intellectuals for its design, but it has "
    "become a global cultural icon of France and one of the most recognisable structures in the world.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b\n    return a\n\n\ndef is_prime(n):\n    if n < 2:\n        return False\n"
    "    for i in range(2, int(n ** 0.5) + 1):\n        if n % i == 0:\n            return False\n    return True\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his wife. Every morning he "
    "rowed out before dawn, and every evening he came home with a basket of fish, until one day his net brought up "
    "a golden fish that spoke to him in a human voice and begged to be set free.",
    "Q: What is 17 multiplied by 23?\nA: 17 times 23 is 391.\nQ: What is the square root of 144?\nA: The square "
    "root of 144 is 12.\nQ: How many minutes are there in a day?\nA: There are 1440 minutes in a day.",
    "Regular exercise has many benefits:\n1. It strengthens the heart and improves circulation.\n2. It helps "
    "control weight by burning calories.\n3. It improves mood and reduces stress and anxiety.\n4. It builds "
    "stronger bones and muscles.\n5. It improves the quality of sleep.",
    "Photosynthesis is the process by which green plants use sunlight to synthesise food from carbon dioxide and "
    "water. It takes place mainly in the chloroplasts of leaf cells, where chlorophyll absorbs light energy and "
    "releases oxygen as a by-product.",
    "<html>\n<head>\n  <title>My Page</title>\n</head>\n<body>\n  <h1>Welcome</h1>\n  <p>This is a simple page "
    "with a list:</p>\n  <ul>\n    <li>First item</li>\n    <li>Second item</li>\n  </ul>\n</body>\n</html>",
    "SELECT customers.name, COUNT(orders.id) AS order_count FROM customers JOIN orders ON orders.customer_id = "
    "customers.id WHERE orders.created_at >= '2024-01-01' GROUP BY customers.name ORDER BY order_count DESC LIMIT 10;",
    "User: Can you recommend a good book about the history of science?\nAssistant: Sure! A Short History of Nearly "
    "Everything by Bill Bryson is a great choice. It covers the history of science in an engaging and humorous way, "
    "from the Big Bang to the rise of civilisation.",
    "In 1969, the Apollo 11 mission landed the first humans on the Moon. Neil Armstrong and Buzz Aldrin spent about "
    "two and a quarter hours outside the lunar module, while Michael Collins remained in orbit aboard the command "
    "module Columbia.",
]
