"""Two narrow hooks into transformers, installed by `import hybridspec` without importing
transformers or torch (they attach when transformers loads).

1. `generate(..., hybridspec=...)` on a model that `hybridspec.enable` never patched reaches
   transformers' model-kwargs validation, whose generic "model_kwargs are not used by the model:
   ['hybridspec']" does not say what to do. The validation is wrapped to raise a ValueError naming
   `hybridspec.enable(model)` when, and only when, a `hybridspec` kwarg is present; every other
   call goes to transformers' own validation unchanged.
2. On a machine without CUDA, transformers advises installing flash-linear-attention and
   causal-conv1d when its GDN layers fall back to pure torch. Both are GPU-only (with fla
   installed, transformers runs fla's Triton kernels even on CPU tensors, which fail), so on such a
   machine that advice is filtered out of transformers' log. Nothing else is filtered.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import re
import sys

GENERATION_MODULE = "transformers.generation.utils"
NOT_ENABLED = (
    "generate(..., hybridspec=...) was called on a {cls} that hybridspec has not patched: call "
    "`hybridspec.enable(model)` once after loading the model (it returns the model), then "
    "`model.generate(..., assistant_model=drafter, hybridspec=True)`."
)
# the loggers that print the fast-path advice (transformers 5.24: hub_kernels; older: the modeling files)
ADVICE_LOGGERS = (
    "transformers.integrations.hub_kernels",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "transformers.models.qwen3_next.modeling_qwen3_next",
)
GPU_ONLY_ADVICE = re.compile(r"flash-linear-attention|fla-org|causal[-_]conv1d")
_MARK = "_hybridspec_hint"


def install() -> None:
    """Idempotent: attach the log filter and the validation hint (now if transformers' generation
    module is loaded, else when it is)."""
    for name in ADVICE_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, GpuOnlyAdviceFilter) for f in log.filters):
            log.addFilter(GpuOnlyAdviceFilter())
    module = sys.modules.get(GENERATION_MODULE)
    if module is not None:
        patch_validation(module)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


class GpuOnlyAdviceFilter(logging.Filter):
    """Drops transformers' advice to install a GPU-only kernel package when CUDA is unavailable."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not GPU_ONLY_ADVICE.search(record.getMessage()):
            return True
        torch = sys.modules.get("torch")
        return torch is not None and torch.cuda.is_available()


def patch_validation(module) -> None:
    """Wrap `GenerationMixin._validate_model_kwargs` of the loaded `transformers.generation.utils`."""
    mixin = getattr(module, "GenerationMixin", None)
    original = getattr(mixin, "_validate_model_kwargs", None)
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def _validate_model_kwargs(self, model_kwargs):
        if "hybridspec" in model_kwargs:
            raise ValueError(NOT_ENABLED.format(cls=type(self).__name__))
        return original(self, model_kwargs)

    setattr(_validate_model_kwargs, _MARK, True)
    mixin._validate_model_kwargs = _validate_model_kwargs


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `transformers.generation.utils` is imported, it hands the real
    spec back with a loader that patches the module right after executing it."""

    def __init__(self):
        self._busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != GENERATION_MODULE or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchingLoader(spec.loader, self)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, finder):
        self._loader, self._finder = loader, finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        patch_validation(module)
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)

    def __getattr__(self, name):
        # get_source, get_filename, ... (inspect and tracebacks read them) from the real loader
        return getattr(self._loader, name)
