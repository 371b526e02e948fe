"""bench/ring_compare.py: two KV rings' valid entries compared in their stores' units, on the CPU, and
bench.prefill_graph_check --smoke (the eager engine against the graph's chunk shapes run eagerly) for every ring.

A comparison must pass what rounding noise upstream does (and the old float tolerance on dequantized values did not),
ignore what no position holds, and fail on a real difference: a code two levels off, entries at the wrong positions,
another rounding mode (a quantizer using floor, put in the ring's writer), a non-finite scale."""

from __future__ import annotations

import pytest
import torch

from bench import prefill_graph_check
from bench.ring_compare import MAX_SHARE, Verdict, compare_rings
from services.talker import kv_cache
from services.talker.kv_cache import kv_cache_type
from services.talker.kv_int4 import LEVELS, quantize_int4

HEADS, CONTEXT, DIM = 4, 32, 16


def vectors(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, HEADS, n, DIM, generator=g), torch.randn(1, HEADS, n, DIM, generator=g)


def ring(bits: int | None, k: torch.Tensor, v: torch.Tensor, first: int = 0, slot: int = 1):
    """A 3-slot ring of one layer with k/v [1, H, n, D] written at positions first.. of `slot`."""
    kv = kv_cache_type(bits)(1, 3, HEADS, CONTEXT, DIM, dtype=torch.float32)
    positions = torch.arange(first, first + k.shape[2])[None]
    kv.write(0, kv.slot_index(slot), positions, k, v)
    kv.length[slot].fill_(first + k.shape[2])
    return kv


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_the_same_writes_are_identical_and_what_no_position_holds_is_not_compared(bits):
    k, v = vectors(20)
    a, b = ring(bits, k, v), ring(bits, k, v)
    pad_k, pad_v = vectors(4, seed=1)
    b.write(0, b.slot_index(1), torch.arange(20, 24)[None], pad_k, pad_v)  # padding past the length, as a graph's
    b.write(0, b.slot_index(2), torch.arange(4)[None], pad_k, pad_v)  # another slot
    diff = compare_rings(a, b, slot=1)
    assert diff.verdict is Verdict.IDENTICAL and diff.entries == 20 and diff.dequantized_max_abs == 0
    assert compare_rings(a, b, slot=1, entries=24).verdict is Verdict.DIFFERENT  # the padding, if it were compared
    assert compare_rings(a, b, slot=2, entries=4).verdict is Verdict.DIFFERENT


@pytest.mark.parametrize("bits", [8, 4])
def test_rounding_noise_upstream_is_rounding_where_a_float_tolerance_failed(bits):
    """k/v moved by about 1e-6 relative (what other fp32 summation orders do): a few stored values go to their
    neighbour, each one step, which the old check's 1e-4 on dequantized values called a failure."""
    k, v = vectors(CONTEXT, seed=2)
    g = torch.Generator().manual_seed(3)
    noisy = [x * (1 + 1e-6 * torch.randn(x.shape, generator=g)) for x in (k, v)]
    diff = compare_rings(ring(bits, k, v), ring(bits, *noisy), slot=1)
    assert diff.verdict is Verdict.ROUNDING, str(diff)
    assert diff.dequantized_max_abs > 1e-4  # the old check: FAIL
    assert all(s.max_steps <= 1 for s in diff.stores)


def test_a_code_two_levels_off_or_a_nan_scale_is_a_difference():
    k, v = vectors(20)
    a, b = ring(4, k, v), ring(4, k, v)
    code = int(b.k[0, 1, 0, 5, 3])
    b.k[0, 1, 0, 5, 3] = (code & 0xF0) | ((code & 15) + 2 if code & 15 < 8 else (code & 15) - 2)
    diff = compare_rings(a, b, slot=1)
    assert diff.verdict is Verdict.DIFFERENT and diff.stores[0].max_steps == 2, str(diff)
    c = ring(4, k, v)
    c.v_scale[0, 1, 2, 7, 1] = float("nan")
    assert compare_rings(a, c, slot=1).verdict is Verdict.DIFFERENT


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_entries_written_one_position_late_are_a_difference(bits):
    k, v = vectors(20)
    late = ring(bits, torch.cat([k[:, :, :1], k], 2), torch.cat([v[:, :, :1], v], 2))  # positions 0, 0..19 at 1..20
    assert compare_rings(ring(bits, k, v), late, slot=1, entries=20).verdict is Verdict.DIFFERENT


def floor_quantize_int4(x):
    """quantize_int4 with codes rounded down instead of to nearest: another writer of the same format."""
    codes, scale, zero = quantize_int4(x)
    halves = x.detach().float().unflatten(-1, (2, -1))
    down = ((halves - zero.float()[..., None]) / scale.float()[..., None]).floor().clamp(0, LEVELS).to(torch.uint8)
    return down[..., 0, :] | (down[..., 1, :] << 4), scale, zero


def test_another_rounding_mode_in_the_writer_is_a_difference(monkeypatch):
    k, v = vectors(CONTEXT, seed=4)
    nearest = ring(4, k, v)
    monkeypatch.setattr(kv_cache, "quantize_int4", floor_quantize_int4)
    floored = ring(4, k, v)
    diff = compare_rings(nearest, floored, slot=1)
    codes = diff.stores[0]
    assert diff.verdict is Verdict.DIFFERENT and codes.max_steps == 1 and codes.differing > MAX_SHARE * codes.elements
    assert all(s.differing == 0 for s in diff.stores[1:])  # scales and minimums are the same: only the codes moved


def test_rings_of_other_formats_are_refused():
    k, v = vectors(4)
    with pytest.raises(ValueError, match="cannot compare"):
        compare_rings(ring(8, k, v), ring(4, k, v), slot=1)


def test_the_graph_check_passes_on_the_cpu_with_the_graphs_chunk_shapes(capsys):
    """The eager engine against the eager engine running each prompt chunk as the captured graph does (padded to 4
    frames, through the 8-, 16- or whole-ring window), both alignments, the 4-bit ring: identical codes, scales and
    minimums (before the 1-frame chunk was attended as a prompt chunk: scales and minimums up to 4 ulps off)."""
    assert prefill_graph_check.main(["--smoke", "--kv-bits", "4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    # per alignment, NATF2.pt (its prefix copied: 28 positions) and a voice recorded for the run (its prefix computed
    # by the slot's pieces, as the captured chunks of voice embeddings: 44)
    assert len(lines) == 4 and all(": IDENTICAL;" in line for line in lines), lines
    assert [("ring indices 0..27" in line, "ring indices 0..43" in line) for line in lines] == [(True, False),
                                                                                              (False, True)] * 2, lines
