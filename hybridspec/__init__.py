"""hybridspec: exact, fast speculative decoding for hybrid Gated-DeltaNet + MoE models.

Qwen3.5/3.6-MoE and Qwen3-Next targets, a DFlash drafter, inside transformers' own `generate`:

    import hybridspec
    drafter = hybridspec.DFlashDrafter.from_pretrained(DRAFTER_DIR, dtype=torch.bfloat16, device="cuda")
    hybridspec.enable(model)              # patches this model instance, once
    out = model.generate(**inputs, assistant_model=drafter, hybridspec=True, max_new_tokens=1024)

`generate` arguments hybridspec adds (after `hybridspec.enable(model)`; everything else about
`generate` stays as it is):

    hybridspec=False         True routes the call through hybridspec; False is stock generate, untouched
    assistant_model=         the drafter: a `hybridspec.DFlashDrafter` (required with hybridspec=True)
    verify_length=None       fixed target tokens per round, anchor included, 2..block size (16 = vanilla DFlash)
    policy="hybridspec"      adaptive length per round; also "nominal", "no_two_stage", "static", "dcut", "evict"
    calibration=None         a JSON artifact path (or a loaded `Calibration`) from `hybridspec calibrate`
    enforce_eager=False      run the fixed-shape runner without CUDA graphs or torch.compile (debugging)
    reference_loop=False     run the host-driven reference loop even where the runner could serve the call
    return_dict_in_generate=True   the output has `hybridspec_stats`: per-round `verify_lengths`,
                             `nominal_lengths`, `accepted`, `mean_acceptance_length`, `rounds`, `decode_seconds`,
                             `prefill_seconds`

Greedy outputs are the target's own, token for token; sampling keeps target-only sampling's
distribution. Public names: `enable`, `disable`, `DFlashDrafter`, `tiny` (a seeded tiny target and
drafter for trying it on a CPU). They load lazily, so `import hybridspec` and `hybridspec --help` do
not import torch or transformers. Importing hybridspec also installs two narrow hints
(`hybridspec._hints`): `generate(..., hybridspec=True)` on a model never enabled raises an error
naming `hybridspec.enable(model)`, and on machines without CUDA transformers' advice to install
flash-linear-attention (GPU only) is not shown.
"""

from hybridspec import _hints

__version__ = "0.1.0.dev0"
__all__ = ["DFlashDrafter", "disable", "enable", "tiny"]

_hints.install()


def __getattr__(name: str):
    # PEP 562: the heavy modules (torch, transformers) load on first use, not on `import hybridspec`
    if name in ("enable", "disable"):
        from hybridspec import api

        return getattr(api, name)
    if name == "DFlashDrafter":
        from hybridspec.drafter.dflash import DFlashDrafter

        return DFlashDrafter
    if name == "tiny":
        import importlib

        return importlib.import_module("hybridspec.tiny")
    raise AttributeError(f"module 'hybridspec' has no attribute {name!r}")
