"""TOOL: list Dynamo's graph breaks in a TinyGPT block with DMuon's hooks (W=2, gloo, CPU).

    PYTHONPATH=. python -m tests.tools.compile_graph_breaks

Runs ``torch._dynamo.explain`` on ``model.blocks[0]`` and on the whole model under DMuon Z2
and Z3 + FSDP2, with and without ``MixedPrecisionPolicy(bf16)``, on two forked ranks (both
must run it: the hooks issue collectives) and prints the graph count, the break count and
each distinct reason with the frame that caused it. docs/user-guide.md
"Activation checkpointing and torch.compile" quotes its output; rerun it after changing the hooks.
"""

from __future__ import annotations

from tests.distributed.parity import compile_tasks as C
from tests.distributed.harness import DistributedPool, RankError


def main() -> None:
    with DistributedPool(2, timeout_s=300) as pool:
        for mode, mp, whole in [(m, mp, w) for w in (False, True) for m in ("z2", "z3") for mp in (False, True)]:
            label = f"{mode}{' bf16' if mp else ''}{' whole model' if whole else ' block'}"
            try:
                result = pool.run(C.graph_breaks, mode, mp, whole)[0]
            except RankError as exc:  # Dynamo or the hooks raised: show the cause, go on
                lines = exc.tracebacks[exc.rank].strip().splitlines()
                last = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1])
                print(f"{label}: failed on rank {exc.rank}: {last[:400]}")
                continue
            print(f"{label}: {result['graphs']} graphs, {result['breaks']} graph breaks")
            for reason in result["reasons"]:
                print(f"  {reason}")


if __name__ == "__main__":
    main()
