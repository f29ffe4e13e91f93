"""Fuzzing ``dmuon-plan``'s arguments: random ``--mesh`` texts, ``--dtype`` names,
cost-model values, flags, models and stray tokens, in any order. Every input must exit 0 (a
plan; JSON that parses under ``--json``) or 2 with exactly one line on stderr: never a
traceback. The ``make test`` profile runs a few seconds; the ``slow`` one many more inputs."""

from __future__ import annotations

import contextlib
import io
import json
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import fast, slow, time_limit
from verify.plan.args import MAX_WORLD_SIZE
from verify.plan.cli import main

#: Mesh sides: small ones (fast to plan) and ones past the bound (rejected before planning);
#: sides in between are valid but cost seconds each, so they are left to the unit tests.
_SIDE = st.one_of(st.integers(-2, 40), st.integers(MAX_WORLD_SIZE + 1, 10**30))
_MESH = st.one_of(
    st.builds(str, _SIDE),
    st.builds(lambda r, sep, n: f"{r}{sep}{n}", _SIDE, st.sampled_from(["x", "X", " x ", "*", ",", "xx"]), _SIDE),
    st.text(alphabet="0123456789xX -+._²e", max_size=8),
)
_DTYPE = st.one_of(
    st.sampled_from(["model", "bfloat16", "bf16", "BF16", "float16", "fp16", "float32", "f32",
                     "float64", "double", "int3", "float31", "int8", "complex64", "", "torch.float32"]),
    st.text(max_size=6),
)
_NUMBER = st.one_of(
    st.sampled_from(["0", "-1", "nan", "inf", "-inf", "1e309", "3", "0.5", "abc", "", "1_000"]),
    st.builds(repr, st.floats(allow_nan=True, allow_infinity=True)),
)
_MODEL = st.sampled_from([
    "llama-tiny", "nope", "tests.plan_factories:raises", "tests.plan_factories:conv_only",
    "tests.plan_factories:relu", "tests.plan_factories:experts_3d",
    "tests.plan_factories:not_a_module", "tests.no_such_module:f", "tests.plan_factories",
])


#: Values a user would pass: half the command lines use only these, so that the plan paths
#: (tables, JSON, warnings, empty plans) are exercised as much as the rejections.
_GOOD = {
    "--model": st.sampled_from(["llama-tiny", "tests.plan_factories:conv_only",
                                "tests.plan_factories:relu", "tests.plan_factories:experts_3d"]),
    "--mesh": st.one_of(st.builds(str, st.integers(1, 40)),
                        st.builds(lambda r, n: f"{r}x{n}", st.integers(1, 12), st.integers(1, 12))),
    "--dtype": st.sampled_from(["model", "bf16", "float16", "fp32", "float64"]),
    "--gpus-per-node": st.sampled_from(["1", "4", "6", "8"]),
    "number": st.one_of(st.sampled_from(["0.5", "3", "100"]),
                        st.builds(repr, st.floats(1e-3, 1e4))),
}
_BAD = {"--model": _MODEL, "--mesh": _MESH, "--dtype": _DTYPE, "--gpus-per-node": _NUMBER,
        "number": _NUMBER}


@st.composite
def argvs(draw, png_dir: str) -> list[str]:
    """One command line: some of the flags with drawn values (all plausible, or any), stray
    tokens, the pairs shuffled."""
    values = _GOOD if draw(st.booleans()) else _BAD
    clean = values is _GOOD
    pairs = []
    if clean or draw(st.integers(0, 9)):  # usually a model
        pairs.append(["--model", draw(values["--model"])])
    if draw(st.integers(0, 4)):
        pairs.append(["--mesh", draw(values["--mesh"])])
    if draw(st.booleans()):
        pairs.append(["--dtype", draw(values["--dtype"])])
    flags = draw(st.lists(st.sampled_from(["--json", "--sweep"]), max_size=2, unique=True))
    if clean and "--sweep" in flags and any(pair[0] == "--mesh" for pair in pairs):
        flags.remove("--sweep")
    pairs += [[flag] for flag in flags]
    for flag in draw(st.lists(st.sampled_from(["--intra-gbps", "--inter-gbps", "--tflops",
                                               "--intra-alpha-us", "--inter-alpha-us",
                                               "--gpus-per-node"]), max_size=3, unique=True)):
        pairs.append([flag, draw(values.get(flag, values["number"]))])
    if draw(st.integers(0, 15)) == 0:  # PNGs are slow to draw: rarely
        pairs.append(["--png", draw(st.sampled_from([f"{png_dir}/w.png", "/nonexistent/dir/w.png",
                                                      png_dir]))])
    if not clean and draw(st.integers(0, 5)) == 0:
        pairs.append([draw(st.sampled_from(["--bogus", "-x", "--", "--mes", "--json=1", "extra"]))])
    pairs = draw(st.permutations(pairs))
    return [tok for pair in pairs for tok in pair]


def _check(argv: list[str]) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            mock.patch("verify.plan.cli.SWEEP_WORLDS", (8, 16)), time_limit(30, f"dmuon-plan {argv}"):
        rc = main(argv)
    stdout, stderr = out.getvalue(), err.getvalue()
    assert rc in (0, 2), (argv, rc, stderr)
    assert "Traceback" not in stderr, (argv, stderr)
    if rc == 2:
        assert stderr.count("\n") == 1 and stderr.startswith("dmuon-plan: "), (argv, stderr)
        return
    assert stdout, argv
    assert all(line.startswith("dmuon-plan: warning: ") for line in stderr.splitlines()), stderr
    if "--json" in argv:
        doc = json.loads(stdout)
        assert doc["schema_version"] == 2 and isinstance(doc["reports"], list)


def test_fuzz_plan_cli_arguments(tmp_path_factory):
    png_dir = str(tmp_path_factory.mktemp("png"))

    @fast(40)
    @given(argvs(png_dir))
    def run(argv):
        _check(argv)

    run()


@pytest.mark.slow
def test_fuzz_plan_cli_arguments_long(tmp_path_factory):
    png_dir = str(tmp_path_factory.mktemp("png"))

    @slow(600)
    @given(argvs(png_dir))
    def run(argv):
        _check(argv)

    run()
