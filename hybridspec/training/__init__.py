"""`hybridspec train-drafter`: training a DFlash drafter for a transformers target.

    options.py   every option, its default and its help (no heavy imports: the CLI reads it)
    data.py      corpus texts, prompt windows, the target's greedy continuations and tap features
    blocks.py    anchors, block inputs, attention masks, loss weights (pure functions)
    forward.py   the batched, differentiable drafter forward over many blocks
    acceptance.py  the held-out report: acceptance length from real speculative runs
    train.py     the loop: optimizer, schedule, checkpoint
    cli.py       the `train-drafter` subcommand
"""
