"""The runner's host-side stopping: built from the criteria `generate` prepares."""

import time

import torch
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
)

from hybridspec.round.stopping import HostStopping


def test_length_eos_and_time_are_evaluated_per_token():
    criteria = StoppingCriteriaList([MaxLengthCriteria(20), EosTokenCriteria(torch.tensor([5, 9]))])
    stop = HostStopping.from_criteria(criteria, max_length=30)
    assert stop.max_length == 20 and stop.eos == {5, 9}
    assert not stop(10, 4) and stop(10, 9) and stop(20, 4)
    late = HostStopping.from_criteria(StoppingCriteriaList([MaxTimeCriteria(0.0, time.time() - 1)]), 100)
    assert late(3, 4)


def test_criteria_that_read_the_sequence_are_refused():
    class Custom(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == 3

    criteria = StoppingCriteriaList([MaxLengthCriteria(20), Custom()])
    assert HostStopping.from_criteria(criteria, 30) is None
