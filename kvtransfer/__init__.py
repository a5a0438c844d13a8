"""The KV offload channel: NATS control plane (protocol), direct data plane, offload tier."""
