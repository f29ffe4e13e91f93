"""The runtime's layering rules, read from the source:

- one module changes dedicated params: only ``dmuon/runtime/bucket.py`` assigns ``.grad``, ``.data``
  or ``m._parameters[...]`` (with its storage primitives in ``residency.py``, which only
  ``bucket.py`` imports); class swaps happen in ``residency.py`` (a param's freed guard) and
  ``attach.py`` (a module's move-following subclass) only;
- no module reads another object's private (underscore) attribute, except the listed torch
  and standard-library ones.
"""

import ast
from pathlib import Path

DMUON = Path(__file__).resolve().parents[2] / "dmuon"

#: Private names of torch / the standard library DMuon uses, and where.
FOREIGN_PRIVATE = {
    "_C": {"residency.py", "runtime.py", "bucket.py"},  # torch._C (graph task id, torch-function toggles)
    "_current_graph_task_id": {"runtime.py", "bucket.py"},
    "_will_engine_execute_node": {"bucket.py"},  # can a grad still arrive (Bucket.grads_pending)
    "_execution_engine": {"runtime.py"},  # queue_callback: the end of backward
    # nn.Module's registry: bucket.py swaps it (as FSDP2 does); precision.py only reads which
    # copy is registered (a module run outside its block's hooks)
    "_parameters": {"bucket.py", "precision.py"},
    # transformers' config: the attention implementation in use (the adapter's only handle)
    "_attn_implementation": {"qk_clip_hf.py"},
    "_unsafe_preserve_version_counter": {"collectives.py"},  # aligned copy-out (as FSDP2 does)
    # a sharded DTensor's local shard, read in placement/stack.py (to_local() makes a new view of
    # a Parameter's); residency.py re-points its .data, as FSDP2 re-points its sharded DTensors
    "_local_tensor": {"stack.py"},
    "_apply": {"attach.py"},  # super()._apply in the move-following subclass
    "_reconstructor": {"attach.py"},  # copyreg: pickling as the original class
    "_set_params_and_buffers_to_ignore_for_model": {"attach.py"},  # DDP's ignore list
    "_ddp_params_and_buffers_to_ignore": {"attach.py"},
    # the default group's timeout, for DMuon's own groups (torch has no public getter)
    "_device_types": {"collectives.py"},
    "_get_backend": {"collectives.py"},
    "_timeout": {"collectives.py"},
    "_optimizer_step_post_hooks": {"optimizer.py"},  # DMuon's refresh stays the last post-hook
    "_version": {"grad_guard.py"},  # a grad's version counter: scaled in place since backward?
    "_per_optimizer_states": {"amp.py"},  # GradScaler's found-Inf flags, agreed over the ranks
    "_get_fsdp_state": {"rest.py"},  # FSDP2's set_requires_gradient_sync flag (reduce_grads)
    "_get_default_store": {"checkpoint.py"},  # the rendezvous store: did every rank call state_dict?
    "_getframe": {"checkpoint.py"},  # is DCP the caller of opt.state_dict()?
    # a torch pipelining schedule's stages and micro-batch count (no public getters)
    "_stages": {"pipeline.py"},
    "_stage": {"pipeline.py"},
    "_n_microbatches": {"pipeline.py"},
    # where a schedule infers its stages' shapes: the torchtitan integration runs it uncounted
    # (torchtitan's stages have no input_args / output_args)
    "_initialize_pp_stages": {"torchtitan.py"},
    # the live groups' names: a pipeline stage's group must get a new one (collectives._stage_group)
    "_world": {"collectives.py"},
}


def _modules():
    for path in sorted(DMUON.rglob("*.py")):  # file names are unique across dmuon's packages
        yield path.name, ast.parse(path.read_text())


def _target_kinds(node: ast.AST):
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    for t in targets:
        if isinstance(t, ast.Attribute) and t.attr in ("grad", "data", "__class__"):
            yield t.attr
        if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and t.value.attr == "_parameters":
            yield "_parameters[]"


def test_only_bucket_changes_params_and_only_it_imports_residency():
    writers: dict[str, set[str]] = {}
    importers = set()
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                for kind in _target_kinds(node):
                    writers.setdefault(kind, set()).add(name)
            if isinstance(node, ast.ImportFrom) and any(a.name == "residency" for a in node.names):
                importers.add(name)
    assert writers["grad"] == {"bucket.py", "rest.py"}  # rest.py: the replicated rest's grads only
    assert writers["_parameters[]"] == {"bucket.py"}
    assert writers["data"] == {"residency.py"}  # flatten_into_views, called by bucket.py only
    assert writers["__class__"] == {"residency.py", "attach.py"}
    assert importers == {"bucket.py"}


def test_no_module_reads_another_objects_private_fields():
    bad = []
    for name, tree in _modules():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")) or node.attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if name not in FOREIGN_PRIVATE.get(node.attr, ()):
                bad.append(f"{name}:{node.lineno}: .{node.attr}")
    assert bad == []
