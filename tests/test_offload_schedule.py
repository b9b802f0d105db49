"""Offload's schedule, through the CPU stand-in for a device, its streams and its host link (``sac2.offload.standin``).

White-box where order is the behaviour: each test reads the stand-in's log of what offload issued (copies to the
host and back, the compute stream's waits, pinned allocations) between markers the checkpointed blocks write when
they run (in forward and in recompute). Each block offloads its input and its matmul's output. The stand-in runs a
side stream's copies only when something waits for them and makes a copy back NaN until it ran, so a missing wait
would show in the gradients, which every test compares with saving the same tensors.
"""

import functools

import pytest
import torch

import sac2
from sac2.core.decisions import SaveList
from sac2.offload import schedule
from sac2.offload.standin import stand_in

aten = torch.ops.aten
MM = aten.mm.default
D = 16
MOVES = ("to_host", "to_device", "wait", "block")


def _block(link, name, x, w):
    link.log.append(("block", name))  # in forward, and again in recompute
    link.name(x, f"{name}.in")
    y = x @ w
    link.name(y, f"{name}.mm")
    return y.relu().sin()


def _weights(n):
    return [torch.randn(D, D, generator=torch.Generator().manual_seed(i), requires_grad=True) for i in range(n)]


def _forward(link, ws, prefix="", seed=0, offload=True):
    """The blocks over one micro-batch: each saves its matmul's output, offloaded with its input when ``offload``."""
    policy = SaveList([MM], offload=[MM] if offload else [], offload_inputs=offload)
    context_fn = functools.partial(sac2.create_selective_checkpoint_contexts, policy)
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(100 + seed), requires_grad=True)
    h = x * 1.0  # an activation: block 0's input moves too
    for i, w in enumerate(ws):
        h = sac2.checkpoint(functools.partial(_block, link, f"{prefix}{i}"), h, w, context_fn=context_fn)
    return x, h.square().sum()


def _grads(x, ws):
    out = [x.grad] + [w.grad for w in ws]
    x.grad = None
    for w in ws:
        w.grad = None
    return out


def _moves(link, since=0):
    return [e for e in link.log[since:] if e[0] in MOVES]


class _Saving:
    """What the same steps give saving the same tensors on the device (no offload)."""

    def __init__(self, ws):
        self.ws = ws

    def grads(self, n_micro=1, **kwargs):
        with stand_in() as link:
            xs = []
            for m in range(n_micro):
                x, loss = _forward(link, self.ws, seed=m, offload=False)
                loss.backward(**kwargs)
                xs.append(x)
            return [_grads(x, []) for x in xs], _grads(xs[0], self.ws)[1:]


def test_each_block_goes_to_the_host_when_the_next_starts_and_the_last_stays_on_the_device():
    ws = _weights(3)
    with stand_in() as link:
        _, loss = _forward(link, ws)
        assert _moves(link) == [
            ("block", "0"), ("to_host", "0.in"), ("to_host", "0.mm"),
            ("block", "1"), ("to_host", "1.in"), ("to_host", "1.mm"),
            ("block", "2"),  # nothing follows block 2 before backward: its input and output stay
        ]
        loss.backward()


def test_backward_copies_back_the_block_it_reaches_next_and_waits_for_each_tensor_as_it_reads_it():
    ws = _weights(3)
    with stand_in() as link:
        x, loss = _forward(link, ws)
        start = len(link.log)
        loss.backward()
        assert _moves(link, start) == [
            ("to_device", "1.in"), ("to_device", "1.mm"),  # while block 2, which reads nothing copied, runs
            ("block", "2"),
            ("to_device", "0.in"), ("to_device", "0.mm"),  # block 1 is reached: block 0's start coming back
            ("wait", "1.in"), ("block", "1"), ("wait", "1.mm"),  # its input before it runs, its output when served
            ("wait", "0.in"), ("block", "0"), ("wait", "0.mm"),
        ]
        got = _grads(x, ws)
    saving = _Saving(ws).grads()
    assert all(torch.equal(a, b) for a, b in zip(got, saving[0][0] + saving[1], strict=True))


def test_micro_batches_forwarded_together_prefetch_in_the_order_their_backwards_run():
    ws = _weights(3)
    with stand_in() as link:
        xa, loss_a = _forward(link, ws, prefix="a", seed=0)
        xb, loss_b = _forward(link, ws, prefix="b", seed=1)  # b's first block sends a's last
        start = len(link.log)
        loss_a.backward()  # a pipeline schedule's order: the first micro-batch's backward first
        backward_a = _moves(link, start)
        start = len(link.log)
        loss_b.backward()
        backward_b = _moves(link, start)
        ga, gb, gw = _grads(xa, []), _grads(xb, []), _grads(xa, ws)[1:]
    assert [e for e in backward_a if e[0] != "block"] == [
        ("to_device", "a2.in"), ("to_device", "a2.mm"),  # sent when b started: fetched as backward reaches it
        ("to_device", "a1.in"), ("to_device", "a1.mm"),
        ("wait", "a2.in"), ("wait", "a2.mm"),
        ("to_device", "a0.in"), ("to_device", "a0.mm"),
        ("wait", "a1.in"), ("wait", "a1.mm"), ("wait", "a0.in"), ("wait", "a0.mm"),
    ]
    assert [e for e in backward_b if e[0] != "block"] == [
        ("to_device", "b1.in"), ("to_device", "b1.mm"),  # b's last block stayed on the device
        ("to_device", "b0.in"), ("to_device", "b0.mm"),
        ("wait", "b1.in"), ("wait", "b1.mm"), ("wait", "b0.in"), ("wait", "b0.mm"),
    ]
    saving = _Saving(ws).grads(n_micro=2)
    assert all(torch.equal(a, b) for a, b in zip(ga + gb + gw, saving[0][0] + saving[0][1] + saving[1], strict=True))


def test_gradient_accumulation_keeps_each_micro_batchs_last_block_on_the_device():
    ws = _weights(2)
    with stand_in() as link:
        for m in range(3):
            start = len(link.log)
            _, loss = _forward(link, ws, prefix=f"m{m}.", seed=m)
            loss.backward()
            moved = {label for kind, label in _moves(link, start) if kind in ("to_host", "to_device")}
            assert moved == {f"m{m}.0.in", f"m{m}.0.mm"}


def test_a_second_backward_through_a_kept_graph_copies_the_blocks_back_again():
    ws = _weights(3)
    with stand_in() as link:
        x, loss = _forward(link, ws)
        loss.backward(retain_graph=True)
        start = len(link.log)
        loss.backward()
        second = [e for e in _moves(link, start) if e[0] == "to_device"]
        got = _grads(x, ws)
    assert second == [("to_device", "1.in"), ("to_device", "1.mm"), ("to_device", "0.in"), ("to_device", "0.mm")]
    saving = _Saving(ws).grads(retain_graph=True)
    with stand_in() as link:
        x, loss = _forward(link, ws, offload=False)
        loss.backward(retain_graph=True)
        loss.backward()
        want = _grads(x, ws)
    assert saving and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.fixture
def limits():
    old = sac2.offload_limits()
    yield
    sac2.offload_limits(*old)


@pytest.mark.usefixtures("limits")
def test_no_prefetch_allowance_copies_each_block_back_only_when_backward_reaches_it():
    sac2.offload_limits(prefetch=0)
    ws = _weights(3)
    with stand_in() as link:
        _, loss = _forward(link, ws)
        start = len(link.log)
        loss.backward()
        assert [e for e in _moves(link, start) if e[0] != "wait"] == [
            ("block", "2"), ("to_device", "1.in"), ("to_device", "1.mm"), ("block", "1"),
            ("to_device", "0.in"), ("to_device", "0.mm"), ("block", "0"),
        ]


@pytest.mark.usefixtures("limits")
def test_a_prefetch_allowance_of_three_tensors_copies_back_that_much_ahead():
    sac2.offload_limits(prefetch=3 * 4 * D * 4)  # three of the (4, D) float32 tensors
    ws = _weights(4)
    with stand_in() as link:
        _, loss = _forward(link, ws)
        start = len(link.log)
        loss.backward()
        assert [e for e in _moves(link, start) if e[0] != "wait"][:5] == [
            ("to_device", "2.in"), ("to_device", "2.mm"), ("to_device", "1.in"),  # three ahead of block 3
            ("block", "3"),
            ("to_device", "1.mm"),  # block 2 reached: its two are no longer ahead
        ]


def test_host_buffers_are_allocated_in_the_first_step_only():
    ws = _weights(3)
    with stand_in() as link:
        allocations = []
        for step in range(3):
            before = link.host_allocations
            _, loss = _forward(link, ws, seed=step)
            loss.backward()
            _grads(torch.zeros(()), ws)
            allocations.append(link.host_allocations - before)
    assert allocations == [4, 0, 0]  # blocks 0 and 1: an input and an output each


@pytest.mark.usefixtures("limits")
def test_at_the_host_memory_cap_what_does_not_fit_stays_on_the_device():
    sac2.offload_limits(host_memory=2 * 4 * D * 4)  # two of the (4, D) float32 tensors
    ws = _weights(3)
    with stand_in() as link, pytest.warns(UserWarning, match="pinned host memory offload may hold"):
        x, loss = _forward(link, ws)
        sent = [label for kind, label in _moves(link) if kind == "to_host"]
        loss.backward()
        got = _grads(x, ws)
    assert sent == ["0.in", "0.mm"]  # block 1's found the pool full: kept where they were
    saving = _Saving(ws).grads()
    assert all(torch.equal(a, b) for a, b in zip(got, saving[0][0] + saving[1], strict=True))


def test_every_copy_back_and_host_buffer_is_let_go_once_backward_has_read_it_step_after_step():
    ws = _weights(3)
    with stand_in() as link:
        held = []
        for step in range(4):
            _, loss = _forward(link, ws, seed=step)
            loss.backward()
            del loss
            pool = schedule.pool(link)
            held.append(pool.held)
            assert link.copies_back_alive() == 0
            assert pool.free_bytes() == pool.held  # every buffer back in the pool
    assert held == [held[0]] * 4 and held[0] == 4 * 4 * D * 4


def test_a_forward_dropped_before_backward_sends_nothing_later_and_gives_its_buffers_back():
    ws = _weights(3)
    with stand_in() as link:
        _, loss = _forward(link, ws, prefix="dropped")
        del loss  # an evaluation with grad on, a retried step: no backward ever reads it
        start = len(link.log)
        _, loss = _forward(link, ws, prefix="next")
        sent = [label for kind, label in _moves(link, start) if kind == "to_host"]
        pool = schedule.pool(link)
        assert not any(label.startswith("dropped") for label in sent)  # its last block was never sent
        assert pool.held == 4 * 4 * D * 4  # the next forward reused the dropped one's buffers
        loss.backward()
