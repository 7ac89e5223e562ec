"""`param_digest`: equal weights, equal digests; a change to any one bit of any parameter, or two words
trading places, changes it; a parameter's digest does not depend on where its storage starts or on the device."""

import pytest
import torch
from torch import nn

from rollplex.executors.metrics import _MIXERS, Fingerprints, param_digest, summed
from rollplex.kernels.fingerprint import BLOCK, fingerprint_words


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(5, 3), nn.LayerNorm(3), nn.Linear(3, 7, bias=False))
    m.append(nn.Embedding(11, 5).to(torch.bfloat16))  # 55 BF16 values: 110 bytes, not whole 64-bit words
    return m


def test_equal_weights_give_equal_digests_and_other_weights_another():
    assert param_digest(model()) == param_digest(model())
    assert param_digest(model()) != param_digest(model(seed=1))


@pytest.mark.parametrize("name", ["0.weight", "1.bias", "2.weight", "3.weight"])
def test_flipping_one_bit_anywhere_changes_the_digest(name):
    m = model()
    before = param_digest(m)
    p = dict(m.named_parameters())[name]
    bits = p.detach().view(-1).view(torch.uint8)
    for byte in (0, bits.numel() // 2, bits.numel() - 1):
        for bit in (0, 7):
            bits[byte] ^= 1 << bit
            assert param_digest(m) != before, (name, byte, bit)
            bits[byte] ^= 1 << bit
    assert param_digest(m) == before


def test_two_words_trading_places_change_the_digest():
    m = model()
    before = param_digest(m)
    data = m[0].weight.detach().view(-1).view(torch.uint8)  # 15 floats: 7 whole 64-bit words and a half
    data[:16] = torch.cat([data[8:16], data[:8]])
    assert param_digest(m) != before


def test_a_parameter_viewing_a_larger_buffer_at_any_offset_digests_as_its_copy():
    m = model()
    expected = param_digest(m)
    weight = m[2].weight.detach()
    for offset in range(4):  # float32 offsets: byte offsets 0, 4, 8, 12
        buffer = torch.zeros(offset + weight.numel() + 3)
        buffer[offset : offset + weight.numel()] = weight.reshape(-1)
        m[2].weight = nn.Parameter(buffer[offset : offset + weight.numel()].view_as(weight))
        assert param_digest(m) == expected, offset


def test_a_parameter_larger_than_a_chunk_is_summed_over_its_chunks(monkeypatch):
    m = model()
    expected = param_digest(m)
    monkeypatch.setattr("rollplex.executors.metrics._WORDS_PER_CHUNK", 2)
    assert param_digest(m) == expected


@pytest.mark.parametrize("n", [0, 1, 7, BLOCK, 3 * BLOCK + 5])
def test_the_fused_fingerprint_equals_torchs_sums_bit_for_bit(n):
    """The GPU's one-launch kernel (here under Triton's interpreter) against torch's ops: words of every magnitude
    (products and sums wrap modulo 2^64), a length that ends inside a block."""
    generator = torch.Generator().manual_seed(n)
    words = torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64, generator=generator)
    words[: min(n, 3)] = torch.tensor([-1, 2**63 - 1, -(2**63)])[: min(n, 3)]
    fused = fingerprint_words(words, _MIXERS, torch.zeros(2, dtype=torch.int64))
    assert torch.equal(fused, summed(words))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_digest_is_the_cpus():
    assert param_digest(model().cuda()) == param_digest(model())
    words = torch.randint(-(2**63), 2**63 - 1, (5 * 2**22 + 3,), dtype=torch.int64)  # more than a chunk of torch's
    fused = fingerprint_words(words.cuda(), _MIXERS, torch.zeros(2, dtype=torch.int64, device="cuda"))
    assert torch.equal(fused.cpu(), summed(words))


def test_fingerprints_launched_then_read_give_the_digest_of_the_weights_at_launch():
    m = model()
    expected = param_digest(m)
    launched = Fingerprints.of(m)
    with torch.no_grad():
        next(m.parameters()).add_(1.0)  # written after the launch: the fingerprints hold the values before
    assert launched.digest() == expected != param_digest(m)
