"""`pdserve operator`: run the kopf operator for InferenceServices (cluster-wide by default)."""
from __future__ import annotations

import os

from pdserve.config import OperatorSettings, from_environ, options, parser


def main(argv: list[str] | None = None) -> int:
    p = parser(OperatorSettings, prog="pdserve operator", description=__doc__)
    p.add_argument("-n", "--namespace", action="append", default=[],
                   help="watch only this namespace (repeatable); default: all namespaces")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL")
    p.add_argument("-v", "--verbose", action="store_true", default=False)
    args = vars(p.parse_args(argv))
    # Flags become the environment the chart sets, which the startup handler reads (kopf runs the
    # handlers module, so the environment is how settings reach it).
    for o in options(OperatorSettings):
        if o.path in args:
            value = args[o.path]
            os.environ[o.env] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    try:
        from_environ(OperatorSettings)
    except ValueError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")

    import kopf

    from . import handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=args["verbose"])
    kopf.run(standalone=True, clusterwide=not args["namespace"], namespaces=args["namespace"] or (),
             liveness_endpoint=args["liveness"] or None)
    return 0
