"""`pdserve operator`: run the kopf operator for InferenceServices (cluster-wide by default)."""
from __future__ import annotations

import argparse
import os


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve operator", description=__doc__)
    p.add_argument("-n", "--namespace", action="append", default=[],
                   help="watch only this namespace (repeatable); default: all namespaces")
    p.add_argument("--image", help="default worker image (env PDSERVE_IMAGE)")
    p.add_argument("--nats-url", help="default NATS URL for workers (env PDSERVE_NATS_URL)")
    p.add_argument("--nats-secret", help="Secret with NATS user/password, in the operator's namespace "
                                         "(env PDSERVE_NATS_SECRET)")
    p.add_argument("--webhook-cert", help="TLS certificate for the admission webhook (env PDSERVE_WEBHOOK_CERT)")
    p.add_argument("--webhook-key", help="TLS key for the admission webhook (env PDSERVE_WEBHOOK_KEY)")
    p.add_argument("--webhook-port", type=int, help="admission webhook port (env PDSERVE_WEBHOOK_PORT, 9443)")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    # Flags become the same environment the chart sets, read once by the startup handler.
    for flag, env in (("image", "PDSERVE_IMAGE"), ("nats_url", "PDSERVE_NATS_URL"),
                      ("nats_secret", "PDSERVE_NATS_SECRET"), ("webhook_cert", "PDSERVE_WEBHOOK_CERT"),
                      ("webhook_key", "PDSERVE_WEBHOOK_KEY"), ("webhook_port", "PDSERVE_WEBHOOK_PORT")):
        value = getattr(args, flag)
        if value is not None:
            os.environ[env] = str(value)

    import kopf

    from . import handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=args.verbose)
    kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace or (),
             liveness_endpoint=args.liveness or None)
    return 0
