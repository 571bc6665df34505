import os

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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
