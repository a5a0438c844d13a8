"""The KV offload channel: NATS control plane (protocol), direct data plane, offload tier.

* `protocol`    — every NATS subject and control message, versioned: the request path reads from it.
* `channel`     — what the workers use: pick a transport per handoff, send, receive, report failures.
* `frames`      — the frame format and the wire form of one layer, which every transport speaks.
* `receiver`    — the receiving end for any transport: agreed transfers, layers being assembled.
* `tcp_send`, `tcp_server` — the direct data path: a TCP stream, or a shared-memory segment it fills.
* `sockio`      — the blocking-socket I/O both TCP ends use.
* `shm`         — shared-memory segments (the receiver's pool, the sender's mappings), host identity.
* `natsdata`    — KV over NATS messages and through the JetStream object store.
* `offload`     — the offload tier: KV blocks in the object store, addressed by prefix hash.
* `compression` — what int8/fp8 on the wire costs, in bytes and in accuracy.
* `layout`      — `KVBlocks`, the block-structured KV payload (its `KVLayout` is in `pdserve.basetypes`).
"""
