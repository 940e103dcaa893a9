"""Threshold encoding: messages against plain torch references, their binary form, the threshold
algorithms, the residual post-processors, and several trainers sharing updates. What every
registered algorithm and post-processor must do is checked in tests/contracts/test_encoding_contract.py."""

from __future__ import annotations

import pickle
import struct

import crc32c
import numpy as np
import pytest
import torch

from dlscale import CorruptDataError, DlscaleError
from dlscale.encoding import (
    HEADER_BYTES,
    RESIDUAL_POST_PROCESSORS,
    THRESHOLD_ALGORITHMS,
    AdaptiveThresholdAlgorithm,
    EncodedUpdate,
    FixedThresholdAlgorithm,
    NonFiniteUpdateError,
    NoOpResidualPostProcessor,
    ResidualClippingPostProcessor,
    TargetSparsityThresholdAlgorithm,
    apply,
    decode,
    describe,
    encode,
    residual_post_processor,
    threshold_algorithm,
)
from dlscale.encoding.threshold import _apply_on_device, _encode_on_device

LENGTHS = [1, 3, 63, 64, 65, 1000, 100_003]
FRACTIONS = [0.0, 1e-3, 1e-2, 0.05, 0.1, 0.5, 1.0]


def reference(r: torch.Tensor, t: float) -> torch.Tensor:
    """What threshold encoding sends: +t where r >= t, -t where r <= -t, else 0."""
    return torch.where(r >= t, t, torch.where(r <= -t, -t, 0.0))


def f32(x: float) -> float:
    return float(np.float32(x))


def update_with(length: int, fraction: float, seed: int = 0) -> tuple[torch.Tensor, float]:
    """Standard normal values and a threshold that about ``fraction`` of them reach."""
    r = torch.randn(length, generator=torch.Generator().manual_seed(seed))
    if fraction == 0:
        return r, 100.0
    if fraction == 1:
        return r.sign() * (r.abs() + 1), 0.5
    return r, float(torch.quantile(r.abs(), 1 - fraction))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern, to compare tensors holding NaN exactly."""
    return t.view(torch.int32)


@pytest.mark.parametrize("form", [None, "sparse", "bitmap"])
@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("length", LENGTHS)
def test_encode_matches_reference(length: int, fraction: float, form: str | None) -> None:
    before, threshold = update_with(length, fraction, seed=length)
    residual = before.clone()
    message = encode(residual, threshold, form=form)
    t = f32(threshold)
    expected = reference(before, t)
    assert message.threshold == t
    assert message.length == length and message.count == int(torch.count_nonzero(expected))
    assert form is None or message.form == form
    assert torch.equal(decode(message), expected)
    assert torch.equal(residual, before - expected)
    replica = torch.zeros(length)
    apply(message, replica)
    assert torch.equal(replica, expected)


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("form", [None, "sparse", "bitmap"])
def test_torch_kernels_match_the_cpu_kernels(device: str, form: str | None) -> None:
    """A residual on a GPU is encoded and applied by torch's kernels there: the same messages, the same
    residual left, the same targets, byte for byte, as numpy's kernels on the CPU give. Run on the CPU
    too, so that the GPU's code is checked where there is no GPU."""
    for length in LENGTHS:
        for fraction in FRACTIONS:
            before, threshold = update_with(length, fraction, seed=length)
            on_cpu, on_device = before.clone(), before.to(device)
            expected = encode(on_cpu, threshold, form=form)
            message = _encode_on_device(on_device, np.float32(threshold), form)
            assert message.to_bytes() == expected.to_bytes()
            assert torch.equal(on_device.cpu(), on_cpu)
            for scale in (1.0, -0.5):
                target = torch.randn(length, generator=torch.Generator().manual_seed(1))
                on_gpu = target.to(device)
                apply(expected, target, scale)
                _apply_on_device(message, on_gpu, np.float32(message.threshold * scale))
                assert torch.equal(on_gpu.cpu(), target)
    residual, kept = torch.ones(1000, device=device), torch.ones(1000)
    residual[700:702] = float("nan")
    with pytest.raises(NonFiniteUpdateError, match="element 700 is nan"):
        _encode_on_device(residual, np.float32(0.5), form)
    kept[700:702] = float("nan")
    assert torch.equal(bits(residual.cpu()), bits(kept))


def test_residual_bookkeeping_is_exact() -> None:
    """Within (-2t, 2t) subtracting t is exact, so residual + message gives back the residual."""
    t = 0.25
    before = (torch.rand(50_000, generator=torch.Generator().manual_seed(3)) * 2 - 1) * (2 * t) * 0.999
    for form in ("sparse", "bitmap"):
        residual = before.clone()
        message = encode(residual, t, form=form)
        assert 0 < message.count < 50_000
        assert torch.equal(residual + decode(message), before)


def test_large_values_stay_in_the_residual() -> None:
    residual = torch.tensor([5.0, -2.5, 0.5, 0.0])
    sent = []
    for _ in range(5):
        sent.append(decode(encode(residual, 1.0)))
    assert torch.equal(sent[0], torch.tensor([1.0, -1.0, 0.0, 0.0]))
    assert torch.equal(sent[1], torch.tensor([1.0, -1.0, 0.0, 0.0]))
    assert torch.equal(sent[2], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert torch.equal(sent[4], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert torch.equal(residual, torch.tensor([0.0, -0.5, 0.5, 0.0]))


def test_form_switches_where_bitmap_becomes_smaller() -> None:
    """4000 elements: a bitmap is 1000 bytes, so up to 249 elements (996 bytes) go sparse."""
    length, t = 4000, 1.0
    positions = torch.randperm(length, generator=torch.Generator().manual_seed(4))
    for count, form in ((0, "sparse"), (1, "sparse"), (249, "sparse"), (250, "bitmap"), (4000, "bitmap")):
        before = torch.full((length,), 0.5)
        before[positions[:count]] = torch.where(positions[:count] % 2 == 0, 1.5, -1.5)
        message = encode(before.clone(), t)
        assert (message.form, message.count) == (form, count)
        assert message.nbytes == HEADER_BYTES + (4 * count if form == "sparse" else 1000)
        forced = {f: encode(before.clone(), t, form=f) for f in ("sparse", "bitmap")}
        assert forced[form] == message
        assert torch.equal(decode(forced["sparse"]), decode(forced["bitmap"]))
        assert torch.equal(decode(message), reference(before, t))


def test_empty_update() -> None:
    before = torch.randn(10_000) * 1e-3
    residual = before.clone()
    message = encode(residual, 1.0)
    assert (message.form, message.count, message.payload.size, message.sparsity) == ("sparse", 0, 0, 0.0)
    assert message.nbytes == HEADER_BYTES
    assert torch.equal(residual, before) and torch.equal(decode(message), torch.zeros(10_000))
    empty = encode(torch.zeros(0), 1.0)
    assert (empty.form, empty.length, empty.count) == ("sparse", 0, 0)
    assert decode(empty).shape == (0,) and EncodedUpdate.from_bytes(empty.to_bytes()) == empty


def test_all_elements_large() -> None:
    before = torch.tensor([3.0, -3.0] * 5001)
    residual = before.clone()
    message = encode(residual, 2.0)
    assert (message.form, message.count) == ("bitmap", 10_002)
    assert torch.equal(decode(message), torch.tensor([2.0, -2.0] * 5001))
    assert torch.equal(residual, torch.tensor([1.0, -1.0] * 5001))


def test_huge_finite_values_encode() -> None:
    """A sum of the residual overflows here, yet every element is finite."""
    residual = torch.full((10_000,), 3e38)
    message = encode(residual, 1e38)
    assert (message.form, message.count) == ("bitmap", 10_000)
    assert torch.equal(residual, torch.full((10_000,), 3e38) - f32(1e38))


@pytest.mark.parametrize("fraction", [1e-3, 1e-2, 0.1, 1.0])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_residual_refused_and_left_unchanged(bad: float, fraction: float) -> None:
    length = 100_003
    before, threshold = update_with(length, fraction, seed=5)
    for where in (0, 64 * 700 + 5, length - 1):
        for form in (None, "sparse", "bitmap"):
            residual = before.clone()
            residual[where] = bad
            residual[where + 1 : where + 3] = bad  # later ones are not the first
            kept = residual.clone()
            with pytest.raises(NonFiniteUpdateError, match=rf"element {where} is {bad}") as info:
                encode(residual, threshold, form=form)
            assert isinstance(info.value, ValueError) and isinstance(info.value, DlscaleError)
            assert torch.equal(bits(residual), bits(kept))


def test_apply_with_scale() -> None:
    before, threshold = update_with(20_000, 1e-2, seed=6)
    for form in ("sparse", "bitmap"):
        message = encode(before.clone(), threshold, form=form)
        target = torch.randn(20_000, generator=torch.Generator().manual_seed(7))
        start = target.clone()
        apply(message, target, scale=0.5)
        assert torch.equal(target, start + decode(message) * 0.5)
        apply(message, target, scale=-1 / 3)
        torch.testing.assert_close(target, start + decode(message) * (0.5 - 1 / 3), rtol=0, atol=1e-6)
        untouched = decode(message) == 0
        assert torch.equal(target[untouched], start[untouched])


def test_apply_checks_its_arguments() -> None:
    message = encode(torch.tensor([2.0, 0.0, -2.0, 0.0, 1.0]), 1.0)
    with pytest.raises(ValueError, match="target has 4 elements, the message encodes 5"):
        apply(message, torch.zeros(4))
    with pytest.raises(TypeError, match="target must be float32"):
        apply(message, torch.zeros(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="target must be a 1-D tensor"):
        apply(message, torch.zeros(5, 1))
    with pytest.raises(ValueError, match="target must be contiguous"):
        apply(message, torch.zeros(10)[::2])
    with pytest.raises(TypeError, match="message must be an EncodedUpdate"):
        apply(decode(message), torch.zeros(5))
    for scale in (float("inf"), float("nan"), 1e300):
        with pytest.raises(ValueError, match="scale must make a finite step"):
            apply(message, torch.zeros(5), scale=scale)
    with pytest.raises(TypeError, match="scale must be a number"):
        apply(message, torch.zeros(5), scale="2")


@pytest.mark.parametrize("form", ["sparse", "bitmap"])
@pytest.mark.parametrize("length", [1, 5, 6, 7, 8, 10_001])
def test_bytes_and_pickle_round_trip(form: str, length: int) -> None:
    before, threshold = update_with(length, 0.3, seed=length)
    message = encode(before.clone(), threshold, form=form)
    data = message.to_bytes()
    assert len(data) == message.nbytes and data[:4] == b"DLTE"
    back = EncodedUpdate.from_bytes(data)
    assert back == message and torch.equal(decode(back), decode(message))
    assert EncodedUpdate.from_bytes(bytearray(data)) == message
    pickled = pickle.dumps(message, protocol=5)
    assert pickle.loads(pickled) == message
    assert len(pickled) < message.nbytes + 400
    assert "torch" not in str(pickled)


def message_bytes(form: int, threshold: float, length: int, count: int, payload: bytes, version: int = 1) -> bytes:
    """The binary form written independently of the codec: header, CRC-32C, payload."""
    head = struct.pack("<4sBBHfQQ", b"DLTE", version, form, 0, threshold, length, count)
    return head + struct.pack("<I", crc32c.crc32c(head + payload)) + payload


def test_independently_written_bytes_are_read() -> None:
    sparse = EncodedUpdate.from_bytes(message_bytes(0, 0.5, 10, 2, np.array([2, -10], "<i4").tobytes()))
    assert torch.equal(decode(sparse), torch.tensor([0, 0.5, 0, 0, 0, 0, 0, 0, 0, -0.5]))
    bitmap = EncodedUpdate.from_bytes(message_bytes(1, 0.5, 5, 2, bytes([0b00001001, 0b00000000])))
    assert torch.equal(decode(bitmap), torch.tensor([0.5, -0.5, 0, 0, 0]))


def test_damaged_bytes_refused() -> None:
    message = encode(torch.tensor([2.0, 0.0, -2.0] * 1000), 1.0)
    data = message.to_bytes()
    flipped = bytearray(data)
    flipped[HEADER_BYTES + 17] ^= 0x10
    cases = {
        "at least": data[: HEADER_BYTES - 1],
        "magic": b"XXXX" + data[4:],
        "checksum": bytes(flipped),
        "payload": data[:-1],
    }
    for match, bad in cases.items():
        with pytest.raises(CorruptDataError, match=match):
            EncodedUpdate.from_bytes(bad)

    def i32(*v: int) -> bytes:
        return np.array(v, "<i4").tobytes()

    invalid = {
        "version 2": message_bytes(0, 1.0, 10, 1, i32(3), version=2),
        "form code 7": message_bytes(7, 1.0, 10, 1, i32(3)),
        "inconsistent": message_bytes(0, 1.0, 10, 11, i32(*range(1, 12))),
        "threshold 0.0": message_bytes(0, 0.0, 10, 1, i32(3)),
        "increasing": message_bytes(0, 1.0, 10, 2, i32(5, -3)),
        "non-zero": message_bytes(0, 1.0, 10, 1, i32(0)),
        "within the length": message_bytes(0, 1.0, 10, 1, i32(11)),
        "code 3": message_bytes(1, 1.0, 4, 1, bytes([0b11])),
        "past its length": message_bytes(1, 1.0, 3, 1, bytes([0b01000000])),
        "says 2 elements": message_bytes(1, 1.0, 4, 2, bytes([0b01])),
    }
    for match, bad in invalid.items():
        with pytest.raises(CorruptDataError, match=match):
            EncodedUpdate.from_bytes(bad)


def test_bad_arguments_refused() -> None:
    r = torch.ones(10)
    for threshold in (0.0, -1.0, float("nan"), float("inf"), 1e-50, 1e39):
        with pytest.raises(ValueError, match="threshold must be positive and finite"):
            encode(r, threshold)
    with pytest.raises(TypeError, match="threshold must be a number"):
        encode(r, "0.1")
    with pytest.raises(TypeError, match="residual must be float32"):
        encode(torch.ones(10, dtype=torch.float64), 0.5)
    with pytest.raises(ValueError, match="residual must be a 1-D tensor"):
        encode(torch.ones(2, 5), 0.5)
    with pytest.raises(ValueError, match="residual must be contiguous"):
        encode(torch.ones(20)[::2], 0.5)
    with pytest.raises(TypeError, match="residual must be a torch.Tensor"):
        encode(np.ones(10, np.float32), 0.5)
    with pytest.raises(ValueError, match="form must be None, 'sparse' or 'bitmap'"):
        encode(r, 0.5, form="dense")
    with pytest.raises(ValueError, match=r"residual has 2147483648 elements; .* at most 2147483646"):
        encode(torch.empty(2**31, device="meta"), 0.5)
    with pytest.raises(ValueError, match="residual is a meta tensor, which holds no values"):
        encode(torch.empty(10, device="meta"), 0.5)
    assert torch.equal(r, torch.ones(10))


def test_message_fields_checked() -> None:
    with pytest.raises(ValueError, match="form must be 'sparse' or 'bitmap'"):
        EncodedUpdate("dense", 1.0, 4, 0, np.zeros(0, np.int32))
    with pytest.raises(ValueError, match="a bitmap payload of a 10-element vector"):
        EncodedUpdate("bitmap", 1.0, 10, 0, np.zeros(2, np.uint8))
    with pytest.raises(ValueError, match="a sparse payload"):
        EncodedUpdate("sparse", 1.0, 10, 1, np.ones(1, np.int64))


def test_describe() -> None:
    before = torch.tensor([3.5, -1.2, 0.4, 0.0, -0.9, 2.0] + [0.0] * 94)
    residual = before.clone()
    message = encode(residual, 1.0)
    stats = describe(message, residual)
    assert stats == {
        "form": "sparse",
        "threshold": 1.0,
        "length": 100,
        "count": 3,
        "sparsity": 0.03,
        "message_bytes": HEADER_BYTES + 12,
        "dense_bytes": 400,
        "residual_l2": pytest.approx(float(torch.linalg.vector_norm(before - reference(before, 1.0)))),
        "residual_max_abs": 2.5,
        "residual_above_threshold": 2,
    }
    with pytest.raises(ValueError, match="residual has 99 elements"):
        describe(message, residual[:99])


def test_sent_indices_are_the_elements_a_message_changes() -> None:
    from dlscale.encoding import sent_indices

    g = torch.Generator().manual_seed(5)
    for form in ("sparse", "bitmap"):
        residual = torch.randn(10_001, generator=g)
        message = encode(residual, 1.5, form=form)
        expected = np.flatnonzero(decode(message).numpy())
        assert message.form == form and len(expected) == message.count > 0
        assert np.array_equal(sent_indices(message), expected)
    assert len(sent_indices(encode(torch.zeros(10), 1.0))) == 0


def test_fixed_threshold() -> None:
    algorithm = FixedThresholdAlgorithm(0.01)
    assert [algorithm.update(s) for s in (0.0, 0.5, 1.0)] == [0.01] * 3
    assert FixedThresholdAlgorithm().threshold == 1e-3


def test_adaptive_threshold_trajectory() -> None:
    algorithm = AdaptiveThresholdAlgorithm(
        initial_threshold=0.1, min_target_sparsity=1e-3, max_target_sparsity=1e-2, decay_rate=0.5
    )
    sparsities = [1e-4, 1e-4, 5e-3, 1e-3, 1e-2, 0.2, 0.2, 0.2, 0.0]
    expected, t = [], 0.1
    for s in sparsities:
        t = t * 0.5 if s < 1e-3 else t / 0.5 if s > 1e-2 else t
        expected.append(t)
    assert [algorithm.update(s) for s in sparsities] == expected
    assert algorithm.threshold == expected[-1]
    default = AdaptiveThresholdAlgorithm()
    assert (default.threshold, default.min_target_sparsity, default.max_target_sparsity) == (1e-3, 1e-4, 1e-2)
    assert default.decay_rate == 0.5 ** (1 / 20)
    for _ in range(20):
        default.update(0.0)
    assert default.threshold == pytest.approx(0.5e-3)


def test_adaptive_threshold_does_not_thin_small_messages() -> None:
    # a 1000-element vector: up to 512 elements, the upper bound is 1/16 instead of 1%
    small, plain = AdaptiveThresholdAlgorithm(decay_rate=0.5), AdaptiveThresholdAlgorithm(decay_rate=0.5)
    assert small.update(0.05, 1000) == 1e-3  # within [1e-4, 1/16]: unchanged
    assert plain.update(0.05) == 2e-3  # without the length, 1% is the bound
    assert small.update(0.1, 1000) == 2e-3  # above 1/16
    # a vector long enough that 1% is more than 512 elements keeps DL4J's bound
    big = AdaptiveThresholdAlgorithm(decay_rate=0.5)
    assert big.update(0.02, 100_000) == 2e-3
    # between: 512 / 20_000 = 2.56%
    mid = AdaptiveThresholdAlgorithm(decay_rate=0.5)
    assert [mid.update(s, 20_000) for s in (0.025, 0.026)] == [1e-3, 2e-3]
    off = AdaptiveThresholdAlgorithm(decay_rate=0.5, small_message_elements=0)
    assert off.update(0.05, 1000) == 2e-3


def test_target_sparsity_threshold_trajectory() -> None:
    algorithm = TargetSparsityThresholdAlgorithm(initial_threshold=1.0, sparsity_target=1e-3, decay_rate=0.8)
    sparsities = [0.0, 1e-4, 1e-3, 2e-3, 0.5]
    expected, t = [], 1.0
    for s in sparsities:
        t = t * 0.8 if s < 1e-3 else t / 0.8 if s > 1e-3 else t
        expected.append(t)
    assert [algorithm.update(s) for s in sparsities] == expected


def test_threshold_stays_a_positive_float32() -> None:
    algorithm = AdaptiveThresholdAlgorithm(decay_rate=0.5)
    for _ in range(200):
        algorithm.update(0.0)
    assert algorithm.threshold == float(np.finfo(np.float32).tiny)
    encode(torch.ones(8), algorithm.threshold)
    for _ in range(400):
        algorithm.update(1.0)
    assert algorithm.threshold == float(np.finfo(np.float32).max)


def test_threshold_algorithm_arguments_validated() -> None:
    bad = [
        (FixedThresholdAlgorithm, {"threshold": 0.0}, "threshold"),
        (FixedThresholdAlgorithm, {"threshold": float("nan")}, "threshold"),
        (AdaptiveThresholdAlgorithm, {"initial_threshold": -1.0}, "initial_threshold"),
        (AdaptiveThresholdAlgorithm, {"min_target_sparsity": 0.0}, "min_target_sparsity"),
        (AdaptiveThresholdAlgorithm, {"max_target_sparsity": 2.0}, "max_target_sparsity"),
        (AdaptiveThresholdAlgorithm, {"min_target_sparsity": 0.1, "max_target_sparsity": 0.01}, "min_target_sparsity"),
        (AdaptiveThresholdAlgorithm, {"decay_rate": 1.0}, "decay_rate"),
        (AdaptiveThresholdAlgorithm, {"decay_rate": 0.2}, "decay_rate"),
        (AdaptiveThresholdAlgorithm, {"small_message_elements": -1}, "small_message_elements"),
        (AdaptiveThresholdAlgorithm, {"small_message_elements": 1.5}, "small_message_elements"),
        (TargetSparsityThresholdAlgorithm, {"sparsity_target": 0.1}, "sparsity_target"),
        (TargetSparsityThresholdAlgorithm, {"decay_rate": "0.9"}, "decay_rate"),
    ]
    for cls, kwargs, name in bad:
        with pytest.raises(ValueError, match=name):
            cls(**kwargs)


def test_threshold_algorithm_registry() -> None:
    assert set(THRESHOLD_ALGORITHMS) == {"adaptive", "fixed", "target_sparsity"}
    assert threshold_algorithm("fixed", threshold=0.1).threshold == 0.1
    instance = TargetSparsityThresholdAlgorithm()
    assert threshold_algorithm(instance) is instance
    with pytest.raises(
        ValueError, match="unknown threshold algorithm 'adaptiv'; known: adaptive, fixed, target_sparsity"
    ):
        threshold_algorithm("adaptiv")
    with pytest.raises(TypeError, match="keyword arguments"):
        threshold_algorithm(instance, decay_rate=0.9)


def test_residual_clipping_frequency_and_bounds() -> None:
    processor = ResidualClippingPostProcessor()
    assert (processor.clip_multiple, processor.frequency) == (5.0, 5)
    start = torch.tensor([12.0, -0.6, 0.3, -7.0, 0.49])
    for iteration in range(12):
        residual = start.clone()
        processor.process(iteration, 0.1, residual)
        if iteration in (5, 10):
            assert torch.equal(residual, torch.clamp(start, -0.5, 0.5))
        else:
            assert torch.equal(residual, start)
    custom = ResidualClippingPostProcessor(clip_multiple=2.0, frequency=1)
    residual = start.clone()
    custom.process(1, 1.0, residual)
    assert torch.equal(residual, torch.tensor([2.0, -0.6, 0.3, -2.0, 0.49]))
    residual = start.clone()
    NoOpResidualPostProcessor().process(5, 0.1, residual)
    assert torch.equal(residual, start)


def test_residual_post_processor_arguments_and_registry() -> None:
    for kwargs, name in (
        ({"clip_multiple": 0.5}, "clip_multiple"),
        ({"frequency": 0}, "frequency"),
        ({"frequency": 2.5}, "frequency"),
    ):
        with pytest.raises(ValueError, match=name):
            ResidualClippingPostProcessor(**kwargs)
    with pytest.raises(ValueError, match="iteration"):
        ResidualClippingPostProcessor().process(-1, 0.1, torch.zeros(3))
    with pytest.raises(ValueError, match="threshold"):
        ResidualClippingPostProcessor().process(5, 0.0, torch.zeros(3))
    assert set(RESIDUAL_POST_PROCESSORS) == {"clipping", "none"}
    assert residual_post_processor("clipping", frequency=3).frequency == 3
    instance = ResidualClippingPostProcessor()
    assert residual_post_processor(instance) is instance
    with pytest.raises(ValueError, match="unknown residual post-processor 'clip'; known: clipping, none"):
        residual_post_processor("clip")


def test_two_trainers_share_updates() -> None:
    """Each trainer adds its updates to its residual and sends messages; both replicas apply every
    message. The replicas stay identical and nothing is lost: the messages sent plus what is left
    in the residuals add up to all the updates."""
    length, steps = 30_011, 60
    g = torch.Generator().manual_seed(8)
    start = torch.randn(length, generator=g)
    replicas = [start.clone(), start.clone()]
    residuals = [torch.zeros(length), torch.zeros(length)]
    algorithms = [AdaptiveThresholdAlgorithm(initial_threshold=0.05).clone() for _ in range(2)]
    total_updates = torch.zeros(length, dtype=torch.float64)
    total_sent = torch.zeros(length, dtype=torch.float64)
    forms = set()
    for step in range(steps):
        messages = []
        for worker in range(2):
            update = torch.randn(length, generator=g) * 0.01 * (1 + step % 7)
            total_updates += update.double()
            residuals[worker] += update
            message = encode(residuals[worker], algorithms[worker].threshold)
            algorithms[worker].update(message.sparsity)
            messages.append(EncodedUpdate.from_bytes(message.to_bytes()))
            forms.add(message.form)
        for message in messages:
            total_sent += decode(message).double()
            for replica in replicas:
                apply(message, replica)
    assert forms == {"sparse", "bitmap"}
    assert torch.equal(replicas[0], replicas[1])
    left = residuals[0].double() + residuals[1].double()
    torch.testing.assert_close(total_sent + left, total_updates, rtol=0, atol=1e-5)
    torch.testing.assert_close(replicas[0].double(), start.double() + total_sent, rtol=0, atol=1e-5)
