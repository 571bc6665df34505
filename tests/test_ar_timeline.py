"""`benchmarks/ar_timeline.py`'s analysis on made-up kernel streams: exposed times add up to a step's
span, overlapped kernels are charged only what they add, and steps and layers are cut where the
real step's kernels would cut them."""

from __future__ import annotations

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
