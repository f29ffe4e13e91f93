"""dmuon.runtime.attach: the class swap that follows a module's moves (``_apply``) keeps the module's
name, repr, pickling and deep copies, and is undone."""

import copy
import io
import pickle

import torch
import torch.nn as nn

from dmuon.runtime import attach


class Listener:
    def __init__(self):
        self.calls = []

    def before_apply(self, module):
        self.calls.append(("before", type(module).__name__, str(module.weight.dtype)))

    def after_apply(self, module, completed):
        self.calls.append(("after", completed, str(module.weight.dtype)))


def test_follow_moves_calls_around_apply_and_keeps_identity():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    plain = repr(model)
    listener = Listener()
    attach.follow_moves(model[0], listener)
    assert type(model[0]).__name__ == "Linear" and isinstance(model[0], nn.Linear)
    assert type(model[0]) is not nn.Linear and repr(model) == plain
    model.double()  # reaches model[0]._apply through the parent's recursion
    assert listener.calls == [("before", "Linear", "torch.float32"), ("after", True, "torch.float64")]
    for restored in (pickle.loads(pickle.dumps(model[0])), copy.deepcopy(model[0])):
        assert type(restored) is nn.Linear and torch.equal(restored.weight, model[0].weight)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    assert type(torch.load(buf, weights_only=False)[0]) is nn.Linear
    attach.unfollow_moves(model[0], listener)
    assert type(model[0]) is nn.Linear and not attach._listeners(model[0])
    model.float()
    assert len(listener.calls) == 2


def test_a_failed_apply_reports_incomplete_and_a_dead_listener_is_skipped():
    lin = nn.Linear(2, 2)
    listener = Listener()
    attach.follow_moves(lin, listener)
    try:
        lin._apply(lambda t: (_ for _ in ()).throw(ValueError("boom")))
    except ValueError:
        pass
    assert listener.calls[-1][:2] == ("after", False)
    del listener
    lin.half()  # the weak reference is dead: a pass-through
    assert lin.weight.dtype == torch.float16


def test_ddp_ignore_list_keeps_the_users_entries_and_is_restored():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model._ddp_params_and_buffers_to_ignore = ["1.bias"]
    before = attach.ignore_in_ddp(model, ["0.weight"])
    assert model._ddp_params_and_buffers_to_ignore == ["1.bias", "0.weight"]
    assert getattr(model[0].weight, "_ddp_ignored", False)
    attach.unignore_in_ddp(model, ["0.weight"], before)
    assert model._ddp_params_and_buffers_to_ignore == ["1.bias"]
    assert not hasattr(model[0].weight, "_ddp_ignored")


def test_dedicated_marks_need_the_live_owner_to_hold_the_very_object():
    """The marks are weak references to the owner (the runtime), never to the param, so
    swap_tensors still works on a dedicated param; a stale id (a param the owner dropped, its
    id reused by another object) is not reported, and a dead owner's marks are ignored."""
    import gc

    class Owner:
        def __init__(self, params):
            self.params = list(params)

        def holds(self, p):
            return any(q is p for q in self.params)

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    owner = Owner([model[0].weight])
    attach.mark_dedicated([model[0].weight, model[1].weight], owner)  # [1]: an id it does not hold
    assert attach.dedicated_names(model) == ["0.weight"]
    torch.utils.swap_tensors(model[0].weight, torch.nn.Parameter(torch.zeros(2, 2)))  # no weakref
    del owner
    gc.collect()
    assert attach.dedicated_names(model) == []
    attach.release_dedicated([model[0].weight, model[1].weight])
