"""Pathways (Google Cloud's single-controller runtime for TPU pods): one Python process drives every chip of
the job through a proxy backend, chosen by JAX_PLATFORMS=proxy. pathwaysutils.initialize() registers that
backend (and Pathways' profiling and, with ENABLE_PATHWAYS_PERSISTENCE=1, its checkpoint array handler). The
job is then one JAX process: jax.distributed.initialize is not called, and checkpoints are written without
OCDBT, as MaxText writes them under Pathways (its enable_single_controller). Off Pathways, nothing here runs.
"""

from __future__ import annotations

import os

from maxtrain.runtime import errors


def used() -> bool:
    """JAX_PLATFORMS names the proxy backend (pathwaysutils' own test, read before JAX starts)."""
    return "proxy" in os.environ.get("JAX_PLATFORMS", "").split(",")


def initialize() -> bool:
    """pathwaysutils.initialize() under Pathways (True); a no-op otherwise (False)."""
    if not used():
        return False
    try:
        import pathwaysutils
    except ImportError:
        raise errors.UserError('JAX_PLATFORMS=proxy (Pathways) needs pathwaysutils: pip install -e ".[pathways]"'
                               ) from None
    if not os.environ.get("JAX_BACKEND_TARGET"):  # where the proxy backend connects (jax_backend_target)
        raise errors.UserError("JAX_PLATFORMS=proxy (Pathways) needs the proxy server's address: "
                               "JAX_BACKEND_TARGET=grpc://HOST:PORT")
    pathwaysutils.initialize()
    return True


def devices():
    """jax.devices(), the proxy server unreachable under Pathways as one line."""
    import jax
    try:
        return jax.devices()
    except RuntimeError as e:
        if not used():
            raise
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise errors.RunError(f"JAX_PLATFORMS=proxy: no Pathways proxy at "
                              f"JAX_BACKEND_TARGET={os.environ.get('JAX_BACKEND_TARGET')} ({first})") from None
