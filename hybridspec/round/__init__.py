"""One decoding round (docs/design.md, "One round"): its stages (`stages`), their composition
(`round.Round`, `round.ar_step`), the prefill hand-over (`prefill.start`), the accept rules
(`accept`), host-side emission and stopping (`emit`, `stopping`) and the per-call statistics
(`stats`). The CUDA-graph runner and the reference loop both run this code."""
