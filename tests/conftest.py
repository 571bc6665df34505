import atexit
import gc
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

# Fixed and derandomized so CI runs the same cases every time; HYPOTHESIS_PROFILE=dev explores more.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    # shrinking interpreted kernels takes minutes; the printed blob reproduces a failure instead
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "dev",
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# HYBRIDSPEC_HIDE_FLA=1 runs the tests as on a machine without fla-core where it is installed (the
# GPU exactness tests run both ways: CONTRIBUTING.md). transformers binds its GDN helpers to fla's
# kernels when it imports a modeling module, so the import is blocked before any test imports it:
# a None entry in sys.modules makes `import fla` raise ImportError.
if os.environ.get("HYBRIDSPEC_HIDE_FLA") == "1":
    sys.modules["fla"] = None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session):
    """In an xdist worker, collect the garbage now and freeze what survives (modules, torch's and
    dynamo's caches: ~0.5-1M objects).

    After this hook the worker reports "finished"; the controller then closes its gateway, and
    execnet gives the worker 5 s to finish before sending it a SIGINT. In those 5 s pytest's
    unraisable-exception cleanup runs 5 full garbage collections, each 0.5-1 s over that heap on
    2 cores, so a loaded worker overran, and the KeyboardInterrupt landed in whatever ran during a
    collection: hypothesis' gc callback, which reported it as a PytestUnraisableExceptionWarning.
    Collecting here, before "finished", still runs every finalizer under pytest's unraisable hook;
    the frozen survivors are then skipped by the collections after it, and unfrozen at exit (after
    execnet's deadline) so that the interpreter's own shutdown still frees them (frozen, Triton's
    nanobind objects are reported as leaked)."""
    if hasattr(session.config, "workerinput"):
        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)
