"""`WeightPager`: a frozen model's weights leave the device between their windows and come back exactly."""

from __future__ import annotations

import torch
from arena_testkit import PoisoningArena

from rollplex.memory.pager import WeightPager
from rollplex.models.config import load_model_config
from rollplex.models.model import Qwen2_5_VL


def test_paging_out_and_in_keeps_the_parameters_and_their_values():
    torch.manual_seed(0)
    model = Qwen2_5_VL(load_model_config("tiny"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    arena = PoisoningArena()
    pager = WeightPager(model, arena)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]  # the same Parameter objects
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert pager.num_bytes >= sum(p.numel() * p.element_size() for p in params)
    pager.page_out()
    assert not pager.resident and all(torch.isnan(p).all() for p in params)  # the device copy is gone
    pager.page_in()
    pager.page_in()  # already resident: nothing happens
    assert pager.resident and all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert [c[0] for c in arena.calls] == ["allocate", "release", "map"]


def test_a_frozen_model_is_copied_out_once_and_again_only_after_a_parameter_is_written():
    torch.manual_seed(0)
    model = Qwen2_5_VL(load_model_config("tiny"))
    arena = PoisoningArena()
    copies = []
    evict = arena.evict
    arena.evict = lambda region, into: (copies.append(region), evict(region, into))
    pager = WeightPager(model, arena)
    pager.page_out()
    pager.page_in()
    pager.page_out()  # the host holds what the parameters hold: the pages go, nothing is copied
    assert len(copies) == 1 and not pager.resident
    pager.page_in()
    head = next(model.parameters())
    with torch.no_grad():
        head.add_(1.0)  # a write (a reference synced to the actor, say): the host copy is stale
    written = {n: p.detach().clone() for n, p in model.named_parameters()}
    pager.page_out()
    pager.page_in()
    assert len(copies) == 2
    assert all(torch.equal(p, written[n]) for n, p in model.named_parameters())
