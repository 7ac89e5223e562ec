import gc
import weakref

import torch

from rollplex.memory.main_grads import MainGrads


def _backward(params, scale: float) -> None:
    sum(((scale + i) * p.float()).sum() for i, p in enumerate(params)).backward()


def test_zeroed_buffers_stay_allocated_and_take_the_next_gradients_in_fp32():
    params = [torch.nn.Parameter(torch.randn(5, 3, dtype=torch.bfloat16)) for _ in range(2)]
    grads = MainGrads(params)
    _backward(params, 0.5)
    first = [grads.grad_of(i) for i in range(2)]
    grads.zero(set_to_none=False)
    assert all(b is f and not b.any() for b, f in zip(grads.buffers, first, strict=True))  # the same buffers, zeroed
    _backward(params, 2.25)
    for i in range(2):
        assert grads.grad_of(i).dtype == torch.float32 and params[i].grad is None
        torch.testing.assert_close(grads.grad_of(i), torch.full((5, 3), 2.25 + i), rtol=0, atol=0)
    grads.zero()
    assert grads.buffers == [None, None]


def test_the_buffers_die_with_their_owner_while_the_parameters_live_on():
    params = [torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))]
    grads = MainGrads(params)
    gone = weakref.ref(grads)
    del grads
    gc.collect()
    assert gone() is None
    _backward(params, 1.0)  # the hook outlives its owner: the gradient stays where autograd put it
    assert params[0].grad is not None
