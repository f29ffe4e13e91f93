"""``DedicatedParts.on_grads_final`` (several model parts, one optimizer): the optimizer's
grads-final hook (its grad view and notes, which read every part's grads) runs once every part's
grads are final, not at the end of the first part's last backward. An interleaved pipeline
schedule ends its parts' backward passes at different times; called early, the hook showed the
other part's grads as DTensors while that part still accumulated into them (torchtitan's
Interleaved1F1B with FSDP2 raised "aten.add_.Tensor got mixed torch.Tensor and DTensor")."""

from types import SimpleNamespace

from dmuon.optim.parts import DedicatedParts


def _part(name: str):
    """The fields of a ``DedicatedParams`` that ``DedicatedParts`` reads, its grads-final
    callbacks kept (``final()`` plays the end of the part's last backward of a step)."""
    fns: list = []
    part = SimpleNamespace(names=[name], params=[object()], placements={name: None},
                           on_grads_final=fns.append, after_zero_grad=lambda: None)
    part.final = lambda: [fn() for fn in fns]
    return part


def test_the_hook_runs_once_every_part_is_final_in_any_order():
    a, b = _part("a"), _part("b")
    calls = []
    DedicatedParts([a, b]).on_grads_final(lambda: calls.append(1))
    a.final()
    assert calls == []  # b's backward passes are still to come
    b.final()
    assert calls == [1]
    b.final()  # the next step, the other order
    assert calls == [1]
    a.final()
    assert calls == [1, 1]


def test_zero_grad_starts_the_parts_over():
    a, b = _part("a"), _part("b")
    calls = []
    parts = DedicatedParts([a, b])
    parts.on_grads_final(lambda: calls.append(1))
    a.final()
    parts.after_zero_grad()  # a step cut short after a's backward
    b.final()
    assert calls == []
    a.final()
    assert calls == [1]
