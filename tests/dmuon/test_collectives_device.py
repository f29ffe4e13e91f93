"""Which device DMuon's collective tensors live on, tested on CPU with
introspected / faked backend names: NCCL needs CUDA tensors, gloo takes CPU ones. What
cannot run here: a real NCCL group (no GPU); the gpu-check runs that path."""

import pytest
import torch
import torch.distributed as dist

from dmuon.runtime import collectives as C


@pytest.mark.parametrize("backend,index,want", [
    ("gloo", None, "cpu"),
    ("nccl", 3, "cuda:3"),
    ("NCCL", 0, "cuda:0"),
    ("cpu:gloo,cuda:nccl", 1, "cpu"),
    ("cuda:nccl", 2, "cuda:2"),
    ("mpi", None, "cpu"),
    ("xccl", 0, "xpu:0"),
])
def test_device_for_backend(backend, index, want):
    assert C.device_for_backend(backend, index) == torch.device(want)


@pytest.mark.parametrize("backend,text", [("nccl", "accel_index=None"), ("bogus", "backend='bogus'")])
def test_device_for_backend_rejects(backend, text):
    with pytest.raises(ValueError, match=text.replace("(", r"\(")):
        C.device_for_backend(backend, None)


def test_served_device_types():
    assert C.served_device_types("gloo") == {"cpu"}
    assert C.served_device_types("nccl") == {"cuda"}
    assert C.served_device_types("cpu:gloo,cuda:nccl") == {"cpu", "cuda"}


def _fake_nccl(monkeypatch, index=5):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: index)


def test_collective_device_reads_the_group_backend(monkeypatch):
    _fake_nccl(monkeypatch)
    assert C.collective_device(object()) == torch.device("cuda", 5)


def test_cpu_params_with_an_nccl_group_raise_naming_the_fix(monkeypatch):
    _fake_nccl(monkeypatch)
    with pytest.raises(ValueError, match=r"Invalid device cpu of x for the 'nccl' process group.*model.to"):
        C.check_param_device(torch.device("cpu"), object(), "x")
    C.check_param_device(torch.device("meta"), object(), "x")  # meta: decided at to_empty


def test_plan_agreement_gathers_on_the_backend_device(monkeypatch):
    seen = []

    class Stop(Exception):
        pass

    def fake_gather(out, inp, **kw):
        seen.extend([out.device, inp.device])
        raise Stop

    monkeypatch.setattr(C, "collective_device", lambda group=None: torch.device("meta"))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(C, "_ALL_GATHER", fake_gather)
    with pytest.raises(Stop):
        C.check_plan_agreement("ab" * 32, "plan")
    assert seen == [torch.device("meta")] * 2


@pytest.mark.parametrize("backend,devices,want", [
    ("nccl", {"meta"}, "nccl"),             # a meta-built model: its backend's policy
    ("nccl", {"cuda"}, "nccl"),
    ("gloo", {"meta"}, "gloo"),
    ("gloo", {"cpu"}, "gloo"),
    ("NCCL", set(), "nccl"),
    ("cpu:gloo,cuda:nccl", {"meta"}, "nccl"),  # materialised on the accelerator (to_empty)
    ("cpu:gloo,cuda:nccl", {"cuda"}, "nccl"),
    ("cpu:gloo,cuda:nccl", {"cuda", "meta"}, "nccl"),
    ("cpu:gloo,cuda:nccl", {"cpu"}, "gloo"),   # CPU params: their collectives run on gloo
    ("cuda:nccl", {"meta"}, "nccl"),
])
def test_link_backend_comes_from_the_group_not_the_params(backend, devices, want):
    """The link policy's key is the group's backend: choosing "nccl" only for CUDA params
    would give the ("nccl", {"meta"}) row gloo's policy."""
    assert C.link_backend(backend, devices) == want


def test_link_backend_rejects_a_list_without_the_params_device():
    with pytest.raises(ValueError, match=r"backend='cpu:gloo,xpu:xccl' for dedicated params on "
                                         r"\['cuda'\]\. Must have an entry for 'cuda'"):
        C.link_backend("cpu:gloo,xpu:xccl", {"cuda"})
