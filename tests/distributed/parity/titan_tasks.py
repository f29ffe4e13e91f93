"""Rank-side tasks of the torchtitan test: torchtitan 0.3.0's own llama3 debug model, its own
``ParallelDims`` meshes and its own ``parallelize_llama`` (wrapped by
``dmuon.integrations.torchtitan.parallelize_fn``), trained with DMuon built by the
integration's optimizer factory, against a single-process ``torch.optim.Muon`` + ``AdamW``
oracle on the same model.

What this module steers so that torchtitan runs on CPU, and nothing else:

- **Device type.** ``torchtitan.tools.utils`` fixes ``device_type = _get_available_device_type()
  or "cuda"`` at import, and ``ParallelDims.build_mesh`` makes its meshes on it; on a machine
  without an accelerator torch's function returns ``None``, so the import runs with it answering
  ``"cpu"`` (restored right after).
- **triton.** ``torchtitan.models.llama3`` imports ``torchtitan.distributed.minimal_async_ep``
  (an expert-parallel all_to_all of MoE models), whose ``kernels`` module imports triton
  unconditionally. Where triton is not installed that one module is replaced by a stand-in
  whose kernels raise when called; a dense llama3 never calls them.
- **Attention.** The debug model's attention is FlexAttention, and torch's FlexAttention has no
  backward on CPU (``NotImplementedError: FlexAttention does not support backward on CPU``,
  ``torch/nn/attention/flex_attention.py``, ``_validate_device``). Each layer's inner attention
  config is swapped for torchtitan's own ``ScaledDotProductAttention.Config`` (causal), the only
  change to the model; on whole sequences without document masks both compute causal attention.
- **Gradient sum on gloo.** ``apply_fsdp_to_decoder`` ends with torchtitan's
  ``disable_fsdp_gradient_division`` (``set_gradient_divide_factor(1.0)``), which makes FSDP2
  reduce-scatter with ``ReduceOp.PREMUL_SUM(1.0)``; gloo has no such op (``RuntimeError: Cannot
  use ReduceOp.PREMUL_SUM with Gloo``). The test then sets FSDP2's
  ``set_force_sum_reduction_for_comms(True)`` on the same modules: the same sum, reduced with
  ``ReduceOp.SUM`` and multiplied by 1.0 after.
- **Model config.** ``Decoder.Config.update_from_config`` imports ``torchtitan.trainer`` (the
  trainer's dataset, metric and logging dependencies); the part of it a llama3 needs here,
  ``set_llama3_sharding_config``, is called directly.

Everything else is torchtitan's: ``ParallelDims(...).build_mesh()``, ``model_config.build()`` on
the meta device, ``parallelize_llama`` (TP via the model's ``parallelize``, FSDP2 via
``apply_fsdp_to_decoder``, which also turns FSDP2's gradient division off), ``to_empty`` +
``init_weights``, the loss convention (each rank's token sum over the global token count) and
``torchtitan.distributed.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import torch
import torch._utils
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import dmuon
from tests.distributed.noise_floor import nudge_init_, oracle_threads
from tests.distributed.parity.dmuon_tasks import ADAMW_LR, MUON_LR

KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
KERNEL_NAMES = ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel",
                "expand_topk_grad_kernel", "fill_combine_metadata_kernel",
                "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
                "reduce_topk_slots_kernel", "topk_scores_grad_kernel")


def _stand_in_kernels() -> None:
    """The triton kernels module replaced by one whose kernels raise (module docstring)."""
    if importlib.util.find_spec("triton") is not None or KERNELS in sys.modules:
        return
    mod = types.ModuleType(KERNELS)

    def kernel(name):
        def run(*args, **kwargs):
            raise RuntimeError(f"{KERNELS}.{name} needs triton, which is not installed.")
        return run

    for name in KERNEL_NAMES:
        setattr(mod, name, kernel(name))
    sys.modules[KERNELS] = mod


def _import_torchtitan() -> None:
    """torchtitan's modules this test uses, imported with the device type steered to ``cpu``
    where torch finds no accelerator (module docstring)."""
    _stand_in_kernels()
    found = torch._utils._get_available_device_type
    if found() is None:
        torch._utils._get_available_device_type = lambda: "cpu"
    try:
        import torchtitan.tools.utils  # noqa: F401  (fixes device_type)
    finally:
        torch._utils._get_available_device_type = found


_import_torchtitan()

from torchtitan.components.loss import cross_entropy_loss  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed import utils as tt_dist  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
import torchtitan.models.llama3 as L  # noqa: E402
from torchtitan.models.llama3.parallelize import parallelize_llama  # noqa: E402
from torchtitan.models.llama3.sharding import set_llama3_sharding_config  # noqa: E402
from torchtitan.tools.utils import device_type  # noqa: E402

from dmuon.integrations import torchtitan as dmt  # noqa: E402

SEQ, ROWS = 32, 4  # the global batch: ROWS sequences of SEQ tokens (+1 for labels)
DIM, HEADS, LAYERS, VOCAB = 64, 4, 2, 256
#: The layouts trained: name -> ParallelismConfig's degrees.
LAYOUTS = {"dp_shard2_tp2": dict(data_parallel_shard_degree=2, tensor_parallel_degree=2),
           "dp_replicate2_dp_shard2": dict(data_parallel_replicate_degree=2,
                                           data_parallel_shard_degree=2)}
#: The clip's max_norm: far above the grad norm, so clipping only measures it.
MAX_NORM = 1e6


def parallelism(layout: str) -> ParallelismConfig:
    return ParallelismConfig(spmd_backend="partial_dtensor", **LAYOUTS[layout])


def model_config(par: ParallelismConfig, layers: int = LAYERS):
    """The llama3 debug model's recipe (torchtitan's ``_debugmodel``: its layer builder, inits,
    fused QKV, RoPE and FFN sizing) at :data:`DIM`, :data:`HEADS`, ``layers`` (:data:`LAYERS`
    unless given) and :data:`VOCAB` instead of 256, 16, 6 and 2048: Newton–Schulz runs in
    bfloat16, which this CPU multiplies at about 0.3 GFLOP/s (0.18 s per GEMM of a 256-wide
    matrix, two minutes per oracle run of two steps at the debug model's size). Attention on SDPA, the sharding set
    (module docstring)."""
    config = L.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=L.Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                          param_init=L._EMBEDDING_INIT),
        norm=L.RMSNorm.Config(normalized_shape=DIM, param_init=L._NORM_INIT),
        lm_head=L.Linear.Config(in_features=DIM, out_features=VOCAB,
                                param_init=L._output_linear_init(DIM)),
        layers=L._build_llama3_layers(
            fuse_qkv=True, n_layers=layers, dim=DIM, n_heads=HEADS,
            hidden_dim=L.compute_ffn_hidden_dim(DIM, multiple_of=256),
            rope=L.ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=4 * SEQ, theta=500000,
                                      scaling="llama"),
            attn_backend="flex"))
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(config, enable_sp=par.enable_sequence_parallel)
    return config


def full_params(model) -> dict[str, torch.Tensor]:
    """Every param of ``model`` as a full tensor (a DTensor gathered: collective over its mesh,
    every rank in the same order)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:], torch.arange(SEQ).expand(ROWS, SEQ)


def token_sum_loss(logits: torch.Tensor, labels: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """torchtitan's convention: this rank's cross-entropy summed over its tokens (torchtitan's
    ``cross_entropy_loss``: loss parallel on TP logits), divided by the global token count."""
    return cross_entropy_loss(logits, labels) / global_tokens


def targets(model) -> list[str]:
    modules = dict(model.named_modules())
    return [n for n, p in model.named_parameters()
            if dmuon.default_predicate(n, p, modules[n.rpartition(".")[0]])]


def oracle(init: dict[str, torch.Tensor], steps: int, nudge: str | None = None) -> dict:
    """One process, the whole batch, from ``init`` (the ranks' init, :func:`train`):
    torch.optim.Muon on DMuon's default targets, AdamW on the rest (the model as many layers
    deep as ``init`` holds), the mean loss over every token. Returns ``init``, the params after each step (``steps``), the grad norm before each
    step (``norms``) and the Muon targets (``muon``)."""
    tt_dist.set_spmd_backend("partial_dtensor")
    with oracle_threads(nudge):
        par = ParallelismConfig(spmd_backend="partial_dtensor")
        layers = len({n.split(".")[1] for n in init if n.startswith("layers.")})
        with torch.device("meta"):
            model = model_config(par, layers).build()
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=None)  # the buffers (RoPE); the params: init
            for n, p in model.named_parameters():
                p.copy_(init[n])
        nudge_init_(model, nudge)
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        named = dict(model.named_parameters())
        muon_names = targets(model)
        muon = torch.optim.Muon([named[n] for n in muon_names], lr=MUON_LR)
        adamw = torch.optim.AdamW([p for n, p in named.items() if n not in muon_names], lr=ADAMW_LR)
        after, norms = [], []
        for step in range(steps):
            ids, labels, pos = batch(step)
            token_sum_loss(model(ids, pos), labels, labels.numel()).backward()
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
            for opt in (muon, adamw):
                opt.step()
                opt.zero_grad()
            after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"init": init, "steps": after, "norms": norms, "muon": muon_names}


def train(steps: int, layout: str, sum_grads: bool = True,
          replicate_declared: bool = True) -> dict:
    """On 4 ranks: torchtitan's meshes for ``layout``, the llama3 of :func:`model_config` built
    on the meta device and parallelized by ``parallelize_llama`` through DMuon's wrapper,
    materialised and initialised by torchtitan (seed 0 on every rank); DMuon from the
    integration's factory or its config; ``steps`` steps on this rank's rows (its ``batch``
    index) with torchtitan's loss convention, the grad norm measured by a clip.
    ``sum_grads=False`` is the control: DMuon averages its grads instead of summing them as torchtitan's FSDP2 does;
    ``replicate_declared=False`` the other: the mesh mapping leaves ``dp_replicate`` undeclared
    (model parallel), so each replica steps its matrices on its own half of the batch.
    Returns the full params at init (``init``) and after each step (``steps``), the grad norm
    before each, the dedicated names, the container's state-dict keys, its base class and the
    NS count."""
    par = parallelism(layout)
    tt_dist.set_spmd_backend(par.spmd_backend)  # as torchtitan's trainer does
    dims = ParallelDims.from_config(par, torch.distributed.get_world_size())
    dims.build_mesh()
    with torch.device("meta"):
        model = model_config(par).build()
    parallelize = dmt.parallelize_fn(parallelize_llama)
    if not replicate_declared:
        mapped = dmt.mesh_dims
        dmt.mesh_dims = lambda d: (mapped(d)[0], None, mapped(d)[2])
    try:
        model = parallelize(model, parallel_dims=dims,
                            training=TrainingConfig(mixed_precision_param="float32"),
                            parallelism=par, compile_config=CompileConfig(), ac_config=None,
                            dump_folder="/tmp")
    finally:
        if not replicate_declared:
            dmt.mesh_dims = mapped
    for m in model.modules():  # gloo has no PREMUL_SUM (module docstring); the same sum in SUM
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device_type)
    torch.manual_seed(0)  # one seed on every rank (torchtitan's set_determinism: distinct on "pp")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    init = full_params(model)
    dm = dmt.dedicated_of(model)
    if not sum_grads:
        for b in dm.buckets:  # DMuon's own average over the data-parallel ranks
            b.divisor = dims.dp_replicate * dims.dp_shard * dims.cp
    if dims.tp > 1:  # the factory, given parallel_dims (checked against the dedicated mesh)
        opts = dmt.build_optimizers([model], dims, lr=MUON_LR, adamw_lr=ADAMW_LR)
    else:  # the config, built as torchtitan's trainer builds its optimizer
        opts = dmt.optimizer_config(lr=MUON_LR, adamw_lr=ADAMW_LR).build(model_parts=[model])
    batch_mesh = dims.get_optional_mesh("batch")
    b, nb = (batch_mesh.get_local_rank(), batch_mesh.size()) if batch_mesh is not None else (0, 1)
    rows = slice(b * ROWS // nb, (b + 1) * ROWS // nb)
    after, norms = [], []
    for step in range(steps):
        ids, labels, pos = batch(step)
        logits = model(ids[rows], pos[rows])
        token_sum_loss(logits, labels[rows], labels.numel()).backward()
        if dims.tp == 1 and replicate_declared:  # torchtitan's clip (torch's get_total_norm)
            norm = tt_dist.clip_grad_norm_(list(model.parameters()), MAX_NORM)
        else:  # under TP torch's stack of per-param norms refuses two meshes (and on the
            # control's mesh, with a model-parallel dim, DMuon shows no DTensor grads): DMuon's
            norm = opts.optimizers[0].clip_grad_norm_(MAX_NORM)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opts.step()
        opts.zero_grad()
        dm.sync_params()
        after.append(full_params(model))
    state = opts.state_dict()  # flat, FQN-keyed (torch DCP), as torchtitan's checkpointer saves
    out = {"state_keys": sorted(state), "init": init, "steps": after, "norms": norms,
           "dedicated": sorted(dm.names),
           "ns_calls": opts.optimizers[0].ns_calls, "kind": type(opts).__mro__[1].__name__}
    dm.close()
    return out
