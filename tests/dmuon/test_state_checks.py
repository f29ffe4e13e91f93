"""The state machine's transition checks raise ``DMuonInternalError`` (dmuon/errors.py), with
or without ``python -O``: every pair of every table, the recover and optional-state rules, and
a planted illegal transition on a real bucket. The ``-O`` run is a subprocess (its control:
``__debug__`` is False there, so a bare ``assert`` would have let every planted change through)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch.nn as nn

from dmuon.errors import DMuonInternalError
from dmuon.runtime import state
from dmuon.runtime.state import Copy, Grads, StateMachine, TrainingState

#: One program, run in this process and under ``python -O``: walks every table, plants illegal
#: transitions, prints one line per result and sets ``ok``. It imports ``dmuon.errors`` and
#: ``dmuon.runtime.state`` only (no torch: under ``-O`` torch's modules would be compiled
#: anew, tens of seconds), through a bare ``dmuon`` package object when run alone.
PROGRAM = textwrap.dedent('''
    import sys
    from dmuon.errors import DMuonInternalError
    from dmuon.runtime import state
    from dmuon.runtime.state import Copy, Grads, StateMachine, TrainingState

    def raises(fn):
        try:
            fn()
        except DMuonInternalError as exc:
            return str(exc)
        return None

    bad = []
    pairs = 0
    for kind, table in state.TRANSITIONS.items():
        for old in kind:
            for new in kind:
                pairs += 1
                allowed = old is new or new in table[old]
                msg = raises(lambda: state.check("obj", old, new))
                if allowed != (msg is None):
                    bad.append((kind.__name__, old.name, new.name, msg))
    # planted illegal changes: through the pass state machine, through recover, and a
    # bucket's copy IN_FLIGHT -> FREED (a free while a broadcast writes it: the one -O let
    # through when the check was an assert)
    sm = StateMachine()
    idle_to_backward = raises(lambda: sm.to(TrainingState.BACKWARD))
    recover_from_idle = raises(sm.recover)
    copy_planted = raises(lambda: state.check("bucket 0 ('blocks.0') copy", Copy.IN_FLIGHT, Copy.FREED))
    print("debug", __debug__)
    print("pairs", pairs)
    print("mismatches", bad)
    print("idle_to_backward", idle_to_backward)
    print("recover_from_idle", recover_from_idle)
    print("copy_planted", copy_planted)
    ok = bool(not bad and idle_to_backward and recover_from_idle and copy_planted
              and sm.state is TrainingState.IDLE)
''')

#: Runs PROGRAM alone: a ``dmuon`` package object without its ``__init__`` (which imports torch).
BARE_PACKAGE = textwrap.dedent('''
    import sys, types
    pkg = types.ModuleType("dmuon")
    pkg.__path__ = [{path!r}]
    sys.modules["dmuon"] = pkg
''')


def _run(optimized: bool, capsys) -> dict[str, str]:
    """PROGRAM's lines, in a ``python -O`` subprocess (``optimized``) or in this process."""
    if optimized:
        root = pathlib.Path(__file__).resolve().parents[2]
        code = BARE_PACKAGE.format(path=str(root / "dmuon")) + PROGRAM + "sys.exit(0 if ok else 1)\n"
        proc = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                              timeout=120, cwd=root)
        assert proc.returncode == 0, (proc.stdout, proc.stderr)
        stdout = proc.stdout
    else:
        namespace: dict = {}
        exec(PROGRAM, namespace)
        assert namespace["ok"]
        stdout = capsys.readouterr().out
    return dict(line.split(" ", 1) for line in stdout.splitlines())


@pytest.mark.parametrize("optimized", [False, True], ids=["plain", "python-O"])
def test_planted_illegal_transitions_raise_with_and_without_O(optimized, capsys):
    out = _run(optimized, capsys)
    assert out["debug"] == str(not optimized)  # -O really stripped asserts in that process
    assert int(out["pairs"]) == sum(len(kind) ** 2 for kind in state.TRANSITIONS)
    assert out["mismatches"] == "[]"
    assert "pass state: illegal state transition IDLE -> BACKWARD" in out["idle_to_backward"]
    assert "pass state (recover): illegal state transition IDLE -> IDLE" in out["recover_from_idle"]
    planted = out["copy_planted"]
    assert "bucket 0 ('blocks.0') copy: illegal state transition IN_FLIGHT -> FREED" in planted
    assert "bug in DMuon" in planted and "report it" in planted


def test_planted_illegal_transition_on_a_real_bucket():
    """A bucket's own write path (``Bucket._to``) goes through the table: a free planted while
    its broadcast is in flight raises and leaves the state as it was."""
    from dmuon.options import DedicateOptions
    from dmuon.placement.dense import Dense
    from dmuon.runtime.bucket import Bucket

    options = DedicateOptions(reshard_after_forward=False).resolve(
        backend="gloo", joins_blocks=True, hsdp=False, allows_flat=True, specs=[], plan=None)
    lin = nn.Linear(4, 4, bias=False)
    b = Bucket(index=0, module_name="blocks.0", module=lin, blocks=("blocks.0",), aligned=False,
               owner=0, shard_owner=0, replicate_owner=0, names=["blocks.0.weight"],
               params=[lin.weight], param_modules=[lin], placements=[Dense("blocks.0.weight")],
               groups=None, divisor=1, is_holder=True, is_owner=True, options=options,
               on_grad=lambda bucket, i: (lambda q: None))
    b.make_compute()
    assert b.copy is Copy.STALE
    b.broadcast_issued(object())
    with pytest.raises(DMuonInternalError, match=r"bucket 0 \('blocks\.0'\) copy: illegal state "
                                                 r"transition IN_FLIGHT -> FREED"):
        b._to("copy", Copy.FREED)
    assert b.copy is Copy.IN_FLIGHT
    with pytest.raises(DMuonInternalError, match="grads: illegal state transition NONE -> REDUCED"):
        b._to("grads", Grads.REDUCED)


def test_internal_error_is_an_assertion_error_not_a_runtime_error():
    """Callers catch RuntimeError for failed collectives (sync_params re-raises those as the
    user's mistake); a bug must not be caught and relabelled there."""
    assert issubclass(DMuonInternalError, AssertionError)
    assert not issubclass(DMuonInternalError, RuntimeError)


def test_recover_leaves_only_an_aborted_pass():
    sm = StateMachine()
    with pytest.raises(DMuonInternalError, match=r"pass state \(recover\): illegal state transition IDLE -> IDLE"):
        sm.recover()
    for aborted in (TrainingState.FORWARD, TrainingState.BACKWARD):
        sm = StateMachine()
        sm.to(TrainingState.FORWARD)
        if aborted is TrainingState.BACKWARD:
            sm.to(TrainingState.FORWARD_DONE)
            sm.to(TrainingState.BACKWARD)
        assert sm.recover() is aborted and sm.state is TrainingState.IDLE


def test_optional_master_state_created_and_dropped_through_the_table():
    assert state.check("m", None, Copy.FREED) is Copy.FREED
    assert state.check("m", None, Copy.STALE) is Copy.STALE
    assert state.check("m", Copy.VALID, None) is None
    with pytest.raises(DMuonInternalError, match="None -> VALID"):
        state.check("m", None, Copy.VALID)
    with pytest.raises(DMuonInternalError, match="IN_FLIGHT -> None"):
        state.check("m", Copy.IN_FLIGHT, None)
    with pytest.raises(DMuonInternalError, match="NONE -> FREED"):  # kinds never mix
        state.check("m", Grads.NONE, Copy.FREED)


def test_no_bare_assert_guards_an_invariant_in_the_runtime():
    """Every invariant check in dmuon/runtime/ and dmuon/ownership/ is an explicit raise (a
    bare ``assert`` vanishes under ``python -O``). The control: this scan finds the one that
    a planted line adds."""
    import ast

    def asserts(text: str) -> int:
        return sum(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(text)))

    root = pathlib.Path(__file__).resolve().parents[2] / "dmuon"
    found = {str(p.relative_to(root)): asserts(p.read_text())
             for sub in ("runtime", "ownership", "optim") for p in (root / sub).glob("*.py")}
    found.update({p.name: asserts(p.read_text()) for p in root.glob("*.py")})
    assert {p: n for p, n in found.items() if n} == {}
    assert asserts("def f(x):\n    assert x > 0\n") == 1  # control
