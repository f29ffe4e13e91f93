"""``dmuon-plan --cp C``: price a layout with a context-parallel axis, the mesh R × N × C
(× T with ``--tp``): W = R·N·C·T, torchtitan's ``dp_replicate × dp_shard × cp × tp``.

DMuon declares cp a shard dim (``shard_dims=("dp_shard", "cp")``, docs/user-guide.md,
"Meshes"), so its dedicated traffic is the data-parallel one at N_eff = N·C: the report's
table (and its ``--tp`` section) is the mesh (R, N·C) (docs/traffic-model.md, "Context
parallelism"). This module adds the CP section:

- ``n_eff``: N·C, the shard group's ranks; each owner's dedicated matrices are broadcast and
  reduced over it.
- the attention's K/V exchange (not DMuon's): per attention layer and step, a rank's part of K
  and of V, a = ``cp_tokens``·kv_width/T elements each (kv_width = n_kv_heads·head_dim of the
  model's ``config``; each TP rank its heads), received as the harness's all-gather form
  verifies it (``verify/traffic/cp.py``): forward two all_gathers, (C-1)·a each; backward two
  all_reduces of C·a, 2(C-1)·a each: ``kv_elems`` = 6(C-1)·L·a per rank and step. A ring
  (torchtitan's ``context_parallel``, not measured here) that passes K and V C-1 hops forward
  and K, V and their grads about C-1 hops each backward receives about the same.
"""

from __future__ import annotations

from verify.plan.kind import PlanContext, PlanKind, given


def kv_width(config) -> int | None:
    """Elements per token of K (and of V): n_kv_heads·head_dim of ``config`` (this repo's
    ``DecoderConfig`` or Hugging Face names); ``None`` when the config does not state them."""
    if config is None:
        return None
    heads = getattr(config, "n_kv_heads", None) or getattr(config, "num_key_value_heads", None) \
        or getattr(config, "n_heads", None) or getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "resolved_head_dim", None) or getattr(config, "head_dim", None)
    width = getattr(config, "d_model", None) or getattr(config, "hidden_size", None)
    q_heads = getattr(config, "n_heads", None) or getattr(config, "num_attention_heads", None)
    if head_dim is None and width and q_heads:
        head_dim = width // q_heads
    if not (isinstance(heads, int) and isinstance(head_dim, int) and heads > 0 and head_dim > 0):
        return None
    return heads * head_dim


def _layers(config) -> int | None:
    v = getattr(config, "n_layers", None) or getattr(config, "num_hidden_layers", None)
    return v if isinstance(v, int) and v > 0 else None


def cp_report(mesh: tuple[int, int], cp: int, *, tp: int = 1, config=None, cp_tokens: int = 8192,
              dtype_bytes: int | None = 2) -> dict:
    """The ``--cp`` section (module docstring) for ``mesh`` = (R, N), C = ``cp``.

    Args:
        tp: T (the K/V heads split over it).
        config: the model's ``config`` (K/V width and layer count); ``None``: the exchange is
            not sized (``kv_elems`` null).
        cp_tokens: tokens of one rank's part of its sequences per step (the sequence length
            / C times the rank's sequences).
        dtype_bytes: bytes per element of K / V (``None``: not priced in bytes).

    Returns ``{"cp", "replicate", "shard", "n_eff", "tp", "world_size", "cp_tokens",
    "kv_width", "layers", "kv_elems", "kv_bytes", "kv_closed_form"}``.
    """
    r, n = mesh
    width, layers = kv_width(config), _layers(config)
    kv = None
    if width is not None and layers is not None:
        a = cp_tokens * width / tp
        kv = 6 * (cp - 1) * layers * a
    return {"cp": cp, "replicate": r, "shard": n, "n_eff": n * cp, "tp": tp,
            "world_size": r * n * cp * tp, "cp_tokens": cp_tokens, "kv_width": width,
            "layers": layers, "kv_elems": kv,
            "kv_bytes": None if kv is None or dtype_bytes is None else kv * dtype_bytes,
            "kv_closed_form": "6(C-1)·L·a, a = cp_tokens·kv_width/T"}


def format_cp(cp: dict) -> str:
    """The CP section as printed under the table."""
    tp = f" --tp {cp['tp']}" if cp["tp"] > 1 else ""
    lines = [f"context parallel: C = {cp['cp']} on dp_shard N = {cp['shard']}: DMuon's shard group "
             f"spans N_eff = N·C = {cp['n_eff']} ranks (the table above is the mesh "
             f"{cp['replicate']}x{cp['n_eff']}{tp}); W = R·N·C·T = {cp['world_size']:,}"]
    if cp["kv_elems"] is None:
        lines.append("  K/V exchange: not sized (the model's config states no K/V width or layer count)")
    else:
        gib = "" if cp["kv_bytes"] is None else f" = {cp['kv_bytes'] / 2**30:.2f} GiB"
        lines.append(f"  K/V exchange (attention's, not DMuon's), per rank and step: 6(C-1)·L·a = "
                     f"{cp['kv_elems']:,.0f} elements{gib} (L = {cp['layers']}, a = {cp['cp_tokens']} "
                     f"tokens x {cp['kv_width']} K/V width / T = {cp['tp']})")
    return "\n".join(lines)


class CPKind(PlanKind):
    """``--cp C`` (:mod:`verify.plan.kind`): with ``--mesh`` and optionally ``--tp``; the
    table is the mesh (R, N·C); not with ``--ep``, ``--pp`` or ``--sweep``."""

    flag = "cp"
    times = {"tp": "T"}
    world_formula = "R·N·C"
    world_fix = "; give a smaller --cp, --tp or --mesh."

    def refusal(self, args) -> str | None:
        if args.sweep or given(args, "ep") or given(args, "pp") or not args.mesh:
            other = "--ep" if given(args, "ep") else "--pp" if given(args, "pp") else "--sweep or no --mesh"
            return self._with(args, other, "Give --mesh N or RxN (dp_replicate x dp_shard) with --cp C "
                                           "[--tp T]: the mesh is R x N x C x T.")
        return None

    def table_mesh(self, args, mesh: tuple[int, int]) -> tuple[int, int]:
        return mesh[0], mesh[1] * self.degree(args)

    def section(self, ctx: PlanContext) -> dict:
        args = ctx.args
        return cp_report(ctx.mesh, self.degree(args), tp=args.tp, config=ctx.config,
                         cp_tokens=args.cp_tokens, dtype_bytes=ctx.dtype_bytes)

    def format(self, section: dict) -> str:
        return format_cp(section)


KIND = CPKind()
