"""The engine's sampler: the C path (every row sampled, none truncated) against exact float64 inverse-CDF
sampling, and the dispatch between it and the PyTorch path."""

import pytest
import torch

from assay.rollout.base import SamplingParams
from assay.rollout.engine import cpu_kernel
from assay.rollout.engine.sampler import sample

pytestmark = pytest.mark.skipif(not cpu_kernel.sample_usable(torch.zeros(1, 1)),  # CI fails it (tests/conftest.py)
                                reason="missing tool: the C kernels did not build (a C compiler with OpenMP)")


def exact_picks(logits: torch.Tensor, temps: list[float], u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the token inverse-CDF sampling picks at u, in float64; the distance from u to the nearest CDF step)."""
    p = torch.softmax(logits.double() / torch.tensor(temps, dtype=torch.float64)[:, None], dim=-1)
    cdf = p.cumsum(-1)
    cdf = cdf / cdf[:, -1:]
    picks = torch.searchsorted(cdf, u[:, None], right=True).squeeze(-1)
    return picks, (cdf - u[:, None]).abs().min(-1).values


@pytest.mark.parametrize("vocab", [5, 64, 1000, 8192])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_c_sampler_picks_what_exact_inverse_cdf_sampling_picks(vocab, threads):
    g = torch.Generator().manual_seed(vocab)
    rows = 40
    logits = torch.randn(rows, vocab, generator=g) * 3
    temps = [0.5 + 0.05 * i for i in range(rows)]
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tokens, logprobs = cpu_kernel.sample_rows(logits, temps, u)
    finally:
        torch.set_num_threads(before)
    want, margin = exact_picks(logits, temps, u)
    clear = margin > 1e-5  # a uniform within rounding of a step may fall either side of it
    assert clear.sum() >= rows // 2  # most are, so the comparison below is not vacuous
    assert torch.equal(torch.tensor(tokens)[clear], want[clear])
    logp = torch.log_softmax(logits / torch.tensor(temps)[:, None], dim=-1)
    assert torch.allclose(torch.tensor(logprobs), logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1),
                          atol=1e-5)


def test_on_a_grid_of_uniforms_each_token_is_drawn_in_proportion_to_its_probability():
    logits = torch.tensor([[2.0, -1.0, 0.5, float("-inf"), 1.0, -3.0, 0.0]])
    grid = 20_000
    u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    tokens, _ = cpu_kernel.sample_rows(logits.expand(grid, -1), [1.0] * grid, u)
    counts = torch.bincount(torch.tensor(tokens), minlength=7)
    want = torch.softmax(logits[0].double(), -1) * grid
    assert counts[3] == 0
    assert (counts - want).abs().max() <= 1.0


def test_a_token_of_probability_zero_is_never_drawn_at_the_ends_of_the_unit_interval():
    vocab = 300  # five blocks; only tokens 70 and 130 are possible
    logits = torch.full((4, vocab), float("-inf"))
    logits[:, 70], logits[:, 130] = 1.0, 1.0
    u = torch.tensor([0.0, 1e-300, 0.5 - 1e-16, 1.0 - 2**-53], dtype=torch.float64)
    tokens, logprobs = cpu_kernel.sample_rows(logits, [1.0] * 4, u)
    assert tokens == [70, 70, 70, 130]
    assert logprobs == pytest.approx([-0.6931472] * 4)


@pytest.mark.parametrize("bad", [float("nan"), "all -inf"])
def test_broken_logits_get_a_clear_error(bad):
    logits = torch.randn(3, 100)
    if bad == "all -inf":
        logits[1] = float("-inf")
    else:
        logits[1, 17] = bad
    with pytest.raises(ValueError, match="NaN or no finite value"):
        cpu_kernel.sample_rows(logits, [1.0] * 3, torch.rand(3, dtype=torch.float64))


def test_mismatched_arguments_get_a_clear_error():
    with pytest.raises(ValueError, match="positive temperatures"):
        cpu_kernel.sample_rows(torch.randn(2, 10), [1.0, 0.0], torch.rand(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="float64 uniforms"):
        cpu_kernel.sample_rows(torch.randn(2, 10), [1.0, 1.0], torch.rand(2))


def test_sample_takes_the_c_path_only_where_it_computes_the_same_thing(monkeypatch):
    """Untruncated sampling goes to C; greedy rows and top-k/top-p/min-p go to PyTorch, as before."""
    calls = []
    real = cpu_kernel.sample_rows
    monkeypatch.setattr(cpu_kernel, "sample_rows", lambda *a: calls.append(1) or real(*a))
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    plain = SamplingParams(temperature=0.8, max_tokens=4)
    sample(logits, [plain] * 3, [7, 8, 9], [0, 1, 2])
    assert calls == [1]
    for other in (SamplingParams(temperature=0.0, max_tokens=4), SamplingParams(temperature=1.0, top_k=5, max_tokens=4),
                  SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4)):
        tokens, _ = sample(logits, [plain, other, plain], [7, 8, 9], [0, 1, 2])
        assert calls == [1]
        if other.temperature == 0:
            assert tokens[1] == int(logits[1].argmax())


def test_seeded_rows_sample_the_same_tokens_on_both_paths(monkeypatch):
    """The same uniforms reach either path, so a seeded request's tokens do not depend on which ran
    (away from rounding at a CDF step, which random logits here are not near)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 2000, generator=g)
    params = [SamplingParams(temperature=1.0, max_tokens=4)] * 16
    streams, positions = list(range(100, 116)), list(range(16))
    fast = sample(logits, params, streams, positions)
    monkeypatch.setattr(cpu_kernel, "sample_usable", lambda _: False)
    slow = sample(logits, params, streams, positions)
    assert fast[0] == slow[0]
    assert torch.allclose(torch.tensor(fast[1]), torch.tensor(slow[1]), atol=1e-5)
