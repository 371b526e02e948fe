"""The step-ahead pairing rule (services/common/pairing.py) with plain numbers: output k leaves once
input k is in, at most one output waits, and the last input's surplus output is dropped."""

from __future__ import annotations

import pytest

from services.common.pairing import OutputPairing, PairingError


def test_an_output_whose_input_is_in_leaves_at_once():
    p = OutputPairing()
    assert p.pair(0, "out0", inputs_in=1) == "out0"
    assert p.pair(1, "out1", inputs_in=3) == "out1"
    assert p.held is None


def test_an_output_ahead_of_its_input_waits_until_that_input_is_in():
    p = OutputPairing()
    assert p.pair(2, "out2", inputs_in=2) is None  # step 2 ran on input 1; input 2 not here yet
    assert p.held == "out2"
    assert p.release(inputs_in=2) is None  # no new input
    assert p.release(inputs_in=3) == "out2"  # input 2 came
    assert p.held is None and p.release(inputs_in=4) is None  # it left once


def test_a_second_output_ahead_of_its_input_is_a_typed_error():
    p = OutputPairing()
    p.pair(0, "out0", inputs_in=0)
    with pytest.raises(PairingError, match="input 1 .* input 0") as e:
        p.pair(1, "out1", inputs_in=0)
    assert (e.value.input_seq, e.value.held_input_seq) == (1, 0)
    assert p.held == "out0"  # the first still waits


def test_after_the_input_ends_the_waiting_and_later_unpaired_outputs_are_dropped():
    p = OutputPairing()
    p.pair(3, "out3", inputs_in=3)
    p.end_input()
    assert p.held is None and p.release(inputs_in=4) is None
    assert p.pair(3, "again", inputs_in=3) is None  # its input never comes: no error, no hold
    assert p.held is None
    assert p.pair(2, "out2", inputs_in=3) == "out2"  # an output whose input is in still leaves
