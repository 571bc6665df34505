"""`benchmarks/ar_timeline.py`'s analysis on made-up kernel streams: exposed times add up to a step's
span, overlapped kernels are charged only what they add, and steps and layers are cut where the
real step's kernels would cut them."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.ar_timeline import Kernel, exposed, split_layers, split_steps, table


def test_exposed_time_charges_only_what_a_kernel_adds_to_the_end():
    ks = [Kernel("a", 0, 10), Kernel("b", 8, 15), Kernel("c", 9, 12), Kernel("d", 20, 21)]
    # b overlaps a by 2 (adds 5), c ends inside b (adds 0), d starts after a gap (adds gap + its run)
    assert exposed(ks) == [10, 5, 0, 6]
    assert sum(exposed(ks)) == ks[-1].end - ks[0].start


def _step(t0: float) -> list[Kernel]:
    """One made-up AR step: embedding, three GDN layers, an attention layer, the LM head; each kernel
    starts 1 us before the previous one ends (PDL overlap), except the cuBLAS GEMMs, 1 us after."""
    gdn = ["nvjet_in", "conv", "gdn_verify_kernel", "small_linear_kernel", "moe_gate_up_kernel", "moe_down_kernel",
           "residual_norm"]
    attn = ["nvjet_qkv", "decode_attention_split_kernel", "small_linear_kernel", "moe_gate_up_kernel",
            "moe_down_kernel", "residual_final_norm"]
    names = ["embed"] + gdn * 3 + attn + ["lm_head_partial_kernel", "lm_head_combine_kernel"]
    out, t = [], t0
    for name in names:
        start = t + 1 if name.startswith("nvjet") else t - 1
        out.append(Kernel(name, start, start + 4))
        t = start + 4
    return out


def test_steps_layers_and_the_table():
    kernels = _step(0) + _step(200) + [Kernel("embed", 400, 401)]
    steps = split_steps(kernels)
    assert [len(s) for s in steps] == [30, 30], "the trailing piece without an LM head is dropped"
    layers, tail, head = split_layers(steps[0])
    assert [[steps[0][i].name for i in r][0] for r in layers] == ["embed", "nvjet_in", "nvjet_in", "nvjet_qkv"]
    assert [steps[0][i].name for i in layers[3]][-1] == "residual_final_norm"
    assert list(tail) == []
    assert [steps[0][i].name for i in head] == ["lm_head_partial_kernel", "lm_head_combine_kernel"]
    out = table(steps)
    assert out["steps"] == 2 and set(out["layers"]) == {"gdn", "attention"}
    # the first layer holds the embedding: one kernel more than the modal GDN layer, so irregular
    assert out["layers"]["gdn"]["per_step"] == 2 and out["layers"]["attention"]["per_step"] == 1
    gdn = out["layers"]["gdn"]["rows"]
    assert [r["name"] for r in gdn][:3] == ["nvjet_in", "conv", "gdn_verify_kernel"]
    # a GEMM 1 us after the previous end: gap 1, exposed 5; a PDL kernel: gap -1, exposed 3
    assert (gdn[0]["gap_us"], gdn[0]["exposed_us"]) == (1, 5)
    assert (gdn[1]["gap_us"], gdn[1]["exposed_us"]) == (-1, 3)
    span = steps[0][-1].end - steps[0][0].start
    parts = out["parts_us"]
    total = parts["irregular"] + parts["tail"] + parts["head"] + sum(
        layer["per_step"] * r["exposed_us"] for layer in out["layers"].values() for r in layer["rows"])
    assert total == pytest.approx(span)
    assert parts["between"] == pytest.approx(200 - span)
    assert parts["irregular"] == pytest.approx(sum(exposed(steps[0])[:8]))
    assert [k["name"] for k in out["one_step"]][:2] == ["embed", "nvjet_in"]


def test_variants_are_checked_before_anything_is_built():
    """`--variants` takes bench_runner's kind:fields form; a bad kind or field stops the run and the
    message names `--variants`."""
    pytest.importorskip("torch")
    from benchmarks.bench_runner import split_variants

    assert split_variants("linear:out_split_k=1;moe:down_block_h=32", "--variants") == [
        ("linear", {"out_split_k": 1}), ("moe", {"down_block_h": 32})]
    with pytest.raises(SystemExit, match="--variants"):
        split_variants("attention:block_n=32", "--variants")
    with pytest.raises(SystemExit, match="--variants: LinearKernelConfig has no field 'nope'"):
        split_variants("linear:nope=1", "--variants")


def test_inductor_kernels_tells_graphs_apart(tmp_path):
    """One kernel name in a GDN and in an attention graph gives two rows, each with its own chosen
    config, its graph's kind and its form; kernels' own modules and non-kernel globals give none."""
    triton = pytest.importorskip("triton")  # a dependency on Linux only (pyproject.toml)
    from types import ModuleType, SimpleNamespace

    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    from benchmarks.ar_timeline import inductor_kernels

    name = "triton_red_fused_add_mean_rsqrt_7"

    def kernel(block: int, warps: int):
        k = CachingAutotuner.__new__(CachingAutotuner)  # a compiled kernel's fields, without compiling
        k.fn = SimpleNamespace(src=f"def {name}(...): # R0_BLOCK {block}")
        k.launchers = [SimpleNamespace(config=triton.Config({"XBLOCK": 1, "R0_BLOCK": block}, num_warps=warps,
                                                            num_stages=1))]
        return k

    def module(file: str, source: str, **attrs):
        path = tmp_path / file
        path.write_text(source)
        mod = ModuleType(file)
        mod.__file__ = str(path)
        for key, value in attrs.items():
            setattr(mod, key, value)
        return mod

    wrapper = "async_compile = AsyncCompile()\ndef call(args):\n    torch.ops.hybridspec.{}.default(x)\n"
    gdn = module("cgdn.py", wrapper.format("gdn_verify_packed"),
                 **{name: kernel(2048, 16), "other": 3})
    attention = module("cattn.py", wrapper.format("decode_attention"),
                       **{name: kernel(512, 4)})
    # a kernel's own module, with the benchmark harness inductor can add to it
    own = module("ckernel.py", "@triton.jit\ndef k(): pass\ndef call(args): pass\n", **{name: kernel(64, 2)})
    rows = inductor_kernels([gdn, attention, own])
    assert [(r["graph"], r["wrapper"], r["kernel"], r["form"]) for r in rows] == [
        ("gdn", "cgdn.py", name, "looped reduction"), ("attention", "cattn.py", name, "looped reduction")]
    assert [r["configs"] for r in rows] == [[dict(XBLOCK=1, R0_BLOCK=2048, num_warps=16, num_stages=1)],
                                            [dict(XBLOCK=1, R0_BLOCK=512, num_warps=4, num_stages=1)]]
    assert rows[1]["source"].endswith("R0_BLOCK 512")


@pytest.mark.gpu
def test_inductor_kernels_reads_a_real_compiled_graph():
    """On CUDA, a compiled reduction's wrapper is found among `PyCodeCache.modules` and its kernel
    listed with one settled config: the torch internals `inductor_kernels` reads are there."""
    import torch
    from torch._inductor.codecache import PyCodeCache

    from benchmarks.ar_timeline import inductor_kernels

    fn = torch.compile(lambda x: (x.float() * x.float()).sum(-1).rsqrt(), dynamic=False)
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(fn(x), (x.float() ** 2).sum(-1).rsqrt())
    rows = [r for r in inductor_kernels(PyCodeCache.modules) if r["graph"] == "other" and "reduction" in r["form"]]
    assert rows and all(len(r["configs"]) >= 1 and r["source"].lstrip().startswith("def ") for r in rows)


def test_an_empty_listing_says_why_instead_of_an_empty_table(tmp_path, monkeypatch, capsys):
    """Where no layer graph's wrapper is among inductor's loaded modules (as under
    TORCHINDUCTOR_FORCE_DISABLE_CACHES on a GPU), the listing is an error that names the way out, not
    an empty table that reads like a graph without inductor kernels."""
    from torch._inductor.codecache import PyCodeCache

    from benchmarks.ar_timeline import kernel_listing

    monkeypatch.setattr(PyCodeCache, "modules", [])
    got = kernel_listing(tmp_path)
    assert isinstance(got, dict) and "TORCHINDUCTOR_CACHE_DIR" in got["error"]
    assert "not listed" in capsys.readouterr().out


def test_fresh_cache_points_inductor_at_an_empty_directory(tmp_path, monkeypatch, capsys):
    """`--fresh-cache`: inductor's cache directory (and so its kernels and coordinate descent's picks)
    is a new empty one, as inductor itself reads it."""
    import tempfile

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from benchmarks.ar_timeline import fresh_inductor_cache

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # set through monkeypatch first, so the variable fresh_inductor_cache writes is restored after
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/nonexistent-before")
    path = fresh_inductor_cache()
    assert cache_dir() == path and not any(Path(path).iterdir())
    assert path in capsys.readouterr().out
    assert fresh_inductor_cache() != path
