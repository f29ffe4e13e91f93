"""The DMuon optimizer: Muon on each dedicated matrix's owner only, AdamW for everything else.

``step()`` issues no collective on 1-D meshes: owners already hold the averaged gradient
(reduced in backward) and non-owners skip the matrix. On HSDP meshes the owner's async
replicate broadcast starts as ``step()`` returns (phase ``replicate``), after the step
post-hooks registered on the optimizer (``register_step_post_hook``: their edits of the owned
params reach every copy); its wait is in the module's next forward pre-hook.

The Muon math is ``torch.optim.Muon``'s (same argument names and defaults, see
``muon_math.py``), applied to every matrix of a dedicated param: a 2-D weight is one, a 3-D
expert stack ``(E, rows, cols)`` is E (momentum, Newton–Schulz and the lr scaling of each
slice as if it were its own parameter), a conv weight is one matrix of its flattened
``(out, in·k…)`` view (``ParamSpec.matrix_shape`` of the plan). Owned matrices of one shape
are orthogonalized in one batch (``muon_update_matrices_``: within one bfloat16 ulp of the
per-matrix path). The AdamW math
is ``torch.optim.AdamW``'s (its functional form, ``foreach=True``: one multi-tensor kernel
per op over the group instead of one kernel per param).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

import torch
from torch.optim import Optimizer
from torch.optim.adam import adam as _adam_functional

from dmuon import annotate
from dmuon.runtime import checkpoint, collectives
from dmuon.runtime.grad_view import fsdp2_mesh
from dmuon.runtime.dedicated_params import DedicatedParams
from dmuon.optim import agreement, amp
from dmuon.optim import parts as parts_mod
from dmuon.optim import groups as groups_mod
from dmuon.optim.grad_guard import GradGuard
from dmuon.optim.hparams import validate_adamw, validate_muon
from dmuon.optim.muon_math import MUON_DEFAULTS
from dmuon.placement.base import StepContext


class DMuon(Optimizer):
    """Muon for dedicated params (on their owner), AdamW for the rest.

    A normal ``torch.optim.Optimizer``. ``param_groups`` holds, for each of the user's groups
    in order, its Muon part (its dedicated params) then its AdamW part (the others), a part
    without params left out (``dmuon/optim/groups.py``): from ``model.parameters()``,
    ``param_groups[0]`` Muon and ``param_groups[1]`` AdamW. Each part has ``algorithm``
    (``"muon"`` / ``"adamw"``) and ``group`` (the user group's index). Every rank lists every
    param, so the groups are identical on all ranks and LR schedulers and ``state_dict`` act
    the same everywhere. Momentum buffers exist only on owners.

    Args:
        params: every parameter of the model (``model.parameters()``, plain tensors or FSDP2
            DTensor shards), or a list of param-group dicts as torch optimizers take (each
            ``{"params": [...], "lr": ..., "weight_decay": ..., ...}``; which key reaches which
            optimizer: ``dmuon/optim/groups.py``). Params in ``dedicated`` go to Muon, the
            rest to AdamW.
        dedicated: the handle from :func:`dmuon.dedicate_params`, or a list of them, one per
            model part this rank holds (an interleaved pipeline schedule's stage modules, all
            dedicated on the same mesh): one optimizer steps them all
            (``dmuon/optim/parts.py``).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn:
            as ``torch.optim.Muon`` (defaults equal). ``ns_coefficients`` may also be a
            sequence of per-step ``(a, b, c)`` (e.g. ``muon_math.polar_express_coefficients(ns_steps)``).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: as ``torch.optim.AdamW``'s
            ``lr, betas, eps, weight_decay`` (defaults equal).

    Attributes:
        ns_calls: matrices orthogonalized by Newton–Schulz on this rank since construction
            (an expert stack of E slices counts E, as ``torch.optim.Muon`` over the slices).

    Raises:
        ValueError: ``dedicated`` is not a :class:`DedicatedParams` (or a list of them on one
            mesh: ``parts.check_parts``), a param group is
            malformed (``groups.user_groups`` / ``groups.split``), a dedicated param is missing
            from ``params``, or a hyper-parameter is invalid (rules in
            ``dmuon/optim/hparams.py``: ``torch.optim.Muon``'s and ``AdamW``'s, checked on every
            rank here and again at each ``step()``, so a rank that owns nothing raises too).
        RuntimeError: the ranks built different optimizers (hyper-parameters, params' shapes,
            dtypes or ``requires_grad``), or another rank raised one of the errors above:
            ``dmuon/optim/agreement.py``, one all_gather of 32 bytes per rank on the default
            group (a collective: build DMuon on every rank).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        *,
        dedicated: DedicatedParams | list[DedicatedParams],
        lr: float = MUON_DEFAULTS["lr"],
        weight_decay: float = MUON_DEFAULTS["weight_decay"],
        momentum: float = MUON_DEFAULTS["momentum"],
        nesterov: bool = MUON_DEFAULTS["nesterov"],
        ns_coefficients=MUON_DEFAULTS["ns_coefficients"],
        eps: float = MUON_DEFAULTS["eps"],
        ns_steps: int = MUON_DEFAULTS["ns_steps"],
        adjust_lr_fn: str | None = MUON_DEFAULTS["adjust_lr_fn"],
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 1e-2,
    ) -> None:
        try:  # local checks: a rank that raises still takes part in the agreement (agreement.py)
            self._build(params, dedicated, dict(
                lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                adjust_lr_fn=adjust_lr_fn), dict(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
                                                 weight_decay=adamw_weight_decay))
        except Exception:
            agreement.agree(None, parts_mod.stage_mesh_of(dedicated))
            raise
        dedicated = self.dedicated
        self._names = dict(zip(map(id, dedicated.params), dedicated.names))
        agreement.agree(agreement.describe(self.param_groups, self._names), dedicated.stage_mesh)
        self._agreed_requires_grad = agreement.requires_grad_of(self.param_groups)

    def _build(self, params, dedicated, muon_defaults: dict, adamw_defaults: dict) -> None:
        """The constructor's local part: checks, the groups, the state (no collective)."""
        if isinstance(dedicated, list | tuple):
            handles = parts_mod.check_parts(dedicated)
            dedicated = handles[0] if len(handles) == 1 else parts_mod.DedicatedParts(handles)
        if not isinstance(dedicated, DedicatedParams | parts_mod.DedicatedParts):
            raise ValueError(
                f"Invalid dedicated={dedicated!r} (type {type(dedicated).__name__}). Must be the "
                "DedicatedParams handle returned by dmuon.dedicate_params(model, mesh), called on "
                "every rank before wrapping: DMuon(model.parameters(), dedicated=dm, ...)."
            )
        given, as_dicts = groups_mod.user_groups(params)
        ids = {id(p) for g in given for p in g["params"]}
        missing, taken = [], []
        for part in parts_mod.parts_of(dedicated):
            lost = [n for n, p in zip(part.names, part.params) if id(p) not in ids]
            missing += lost
            taken += groups_mod.taken_by_fsdp(part, lost)
        if taken:
            raise ValueError(
                f"Invalid params: dedicated params {taken[:3]} are not among them: their modules "
                "now hold FSDP2 DTensor shards in their place, so fully_shard managed them "
                "(it was called without ignored_params). Pass ignored_params=set(dm) to every "
                "fully_shard call over a module that holds them: fully_shard(module, mesh=mesh, "
                "ignored_params=set(dm)), after dmuon.dedicate_params."
            )
        if missing:
            raise ValueError(
                f"Invalid params: dedicated params {missing[:3]} are not among them. Pass "
                "model.parameters() of the model given to dedicate_params (or groups that hold "
                "every one of its params)."
            )
        groups = groups_mod.split(given, dedicated, muon_defaults, adamw_defaults)
        if not groups:
            raise ValueError("Invalid params: no parameters (every group is empty). Pass "
                             "model.parameters().")
        for group in groups:  # named after the user's group (the parts are not theirs)
            check = validate_muon if group["algorithm"] == "muon" else validate_adamw
            check(group, f"params[{group['group']}]." if as_dicts else "")
        super().__init__(groups, defaults={})
        self.dedicated = dedicated
        self.ns_calls = 0
        self._warned_partial = False  # checkpoint.warn_partial_save: once
        self._owned = {id(p) for p in dedicated.owned()}
        self._launchers: dict = {}  # placements' step collectives: one Launcher per device
        # the placement kinds present, in step_order (every rank: the same list)
        self._kinds = sorted({type(pl) for pl in dedicated.placements.values()},
                             key=lambda k: k.step_order)
        # Muon's view of each dedicated param: (rows, cols) of one matrix (stack or conv layout)
        self._matrix_of = {k: v for part in parts_mod.parts_of(dedicated)
                           for k, v in parts_mod.matrix_shapes(part).items()}
        checkpoint.complete_state(self)  # the state DCP's templates need, before the first step
        # torch's clip_grad_norm_: the global norm where FSDP2 handles the rest (dedicated grads
        # shown as DTensors on its mesh: runtime/grad_view.py), else the step refuses after it
        # (grad_guard.py). TP-sharded grads are DTensors on the TP mesh: not shown.
        adamw = [p for g in self.param_groups if g["algorithm"] == "adamw" for p in g["params"]]
        shows = all(part.layout.shows_grad_view for part in parts_mod.parts_of(dedicated))
        self._grad_mesh = fsdp2_mesh(adamw) if shows else None
        self._guard = GradGuard()
        # The refresh (copies STALE, HSDP replicate broadcast) runs as the last step post-hook,
        # so the user's post-hooks edit the masters before any copy or broadcast reads them.
        self._stepped = False
        self._refresh = super().register_step_post_hook(self._after_hooks)
        final = weakref.WeakMethod(self._grads_final)  # dm must not keep a dropped optimizer alive
        dedicated.on_grads_final(lambda: final() is not None and final()())

    # ------------------------------------------------------------------ state and checkpoints
    def momentum_of(self, p: torch.Tensor) -> torch.Tensor:
        """The Muon momentum buffer of an owned dedicated param: created where missing
        (``Placement.new_momentum``: zeros as ``torch.optim.Muon`` creates at a param's first
        step; DMuon creates it when the optimizer is built), cast to ``p``'s dtype and device
        after a move."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = self.dedicated.placement_of(p).new_momentum(p)
        checkpoint.follow_moves(state, ("momentum_buffer",), p)
        return state["momentum_buffer"]

    def matrix_shape(self, p: torch.Tensor) -> tuple[int, int]:
        """Muon's view of a dedicated param: (rows, cols) of one matrix (a stack's or a conv's
        layout: ``ParamSpec.matrix_shape``)."""
        return self._matrix_of[id(p)]

    def launcher(self, device: torch.device) -> collectives.Launcher:
        """This optimizer's :class:`~dmuon.runtime.collectives.Launcher` on ``device`` (created on
        first use): a placement's step collectives, e.g. TP's gather and scatter."""
        if device not in self._launchers:
            self._launchers[device] = collectives.Launcher(device)
        return self._launchers[device]

    @staticmethod
    def new_adamw_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
        """A fresh AdamW state for ``p`` (``torch.optim.AdamW``'s, CPU ``step`` tensor): step 0
        (a 0-d tensor of the default dtype) and zero ``exp_avg`` / ``exp_avg_sq`` like ``p``."""
        return {
            "step": torch.tensor(0.0, dtype=torch.get_default_dtype()),
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }

    def state_dict(self) -> dict:
        """``torch.optim.Optimizer.state_dict()``, complete on every rank (DCP-ready).

        What each rank's ``state`` holds (details in :mod:`dmuon.runtime.checkpoint`): for each
        dedicated param that requires grad, ``{"momentum_buffer": tensor}`` (shape and dtype
        of the param) on its owner and ``{}`` on every other rank; for every other param that
        requires grad, AdamW's ``step`` / ``exp_avg`` / ``exp_avg_sq``. ``param_groups`` are
        identical on every rank. Before the first step the tensors are the zeros the first
        step would start from. Save it on every rank (momentum is on owners only), or use
        DCP's ``get_state_dict`` + ``dcp.save``. No collective. The dict also has the key
        ``checkpoint.SAVED_BY_KEY`` (``{"rank", "world_size", "momentum_of"}``), which
        :meth:`load_state_dict` names when a rank loads another rank's save.

        Warns:
            checkpoint.PartialStateWarning: once per optimizer, on more than one rank and
                outside DCP: this rank's dict lacks the other owners' momentum.
        """
        checkpoint.complete_state(self)
        out = super().state_dict()
        record = checkpoint.saved_by(self)
        out[checkpoint.SAVED_BY_KEY] = record
        if not self._warned_partial:
            self._warned_partial = checkpoint.warn_partial_save(self, record)
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.Optimizer.load_state_dict``, keeping momentum on owners only.

        Accepts this rank's own ``state_dict()`` (same ownership plan) or DCP's
        ``set_state_dict`` input at any world size. Momentum given for params this rank does
        not own is dropped.

        Raises:
            ValueError: the param groups differ in number or size, or a dedicated param this
                rank owns has no ``momentum_buffer`` of its shape (a state dict saved by
                another rank or under another ownership plan).
        """
        super().load_state_dict(checkpoint.filter_loaded_state(self, state_dict))
        checkpoint.complete_state(self)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, pipeline_group=None) -> torch.Tensor:
        """Clip every param's grad by the global norm over all ranks (a collective: call it
        on every rank between ``backward()`` and ``step()``). Works in every mode; under DDP
        and ``rest="replicate"`` use it instead of ``torch.nn.utils.clip_grad_norm_``, which
        would see each dedicated grad on its owner only (under FSDP2 torch's is global too:
        ``dmuon/runtime/grad_view.py``). Under pipeline parallelism pass ``pipeline_group`` (this
        rank's pipeline group) for the norm of the whole model. Arguments, return value and
        errors: :func:`dmuon.optim.clip.clip_grad_norm_`."""
        from dmuon.optim.clip import clip_grad_norm_

        muon = [p for g in self.param_groups if g["algorithm"] == "muon" for p in g["params"]]
        adamw = [p for g in self.param_groups if g["algorithm"] == "adamw" for p in g["params"]]
        self.dedicated.take_back_grads()
        total = clip_grad_norm_(self.dedicated, muon, adamw, max_norm, norm_type, error_if_nonfinite,
                                pipeline_group=pipeline_group)
        self._grads_final()  # scaled here, by the global norm: what step() compares against
        return total

    def clip_grad_value_(self, clip_value: float) -> None:
        """``torch.nn.utils.clip_grad_value_`` over every param's grad (elementwise: local, no
        collective; right on the grads where ``step()`` reads them). torch's own function over
        ``model.parameters()`` does the same (under FSDP2 on the shown DTensor grads:
        ``dmuon/runtime/grad_view.py``); this one also covers TP-sharded params, clipping each
        kind (each DTensor mesh) on its own.

        Raises:
            ValueError: ``clip_value`` not a finite number > 0.
        """
        if isinstance(clip_value, bool) or not isinstance(clip_value, int | float) or not (
                0 < clip_value < math.inf):
            raise ValueError(f"Invalid clip_value={clip_value!r}. Must be a finite number > 0.")
        self.dedicated.take_back_grads()
        kinds: dict[object, list[torch.Tensor]] = {}
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    kinds.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
        for params in kinds.values():
            torch.nn.utils.clip_grad_value_(params, clip_value)
        self._grads_final()

    def _grads_final(self) -> None:
        """Every grad is final (end of backward, or DMuon's clip): show the dedicated grads as
        DTensors where FSDP2 handles the rest, then note the plain ones for the guard."""
        if self._grad_mesh is not None:
            self.dedicated.show_grads(self._grad_mesh)
        self._guard.note(p for g in self.param_groups for p in g["params"])

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group`` while the constructor builds the
        groups; afterwards it raises.

        Raises:
            ValueError: called on a built DMuon (its groups are fixed: pass every group to the
                constructor).
        """
        if hasattr(self, "dedicated"):  # set once the constructor has built the groups
            raise ValueError(
                f"Invalid add_param_group({sorted(param_group) if isinstance(param_group, dict) else param_group!r}): "
                "DMuon's param groups are fixed when it is built (a Muon part and an AdamW part "
                "per group given to DMuon(...), the same on every rank). Pass every group to the "
                "constructor: DMuon([{'params': ...}, {'params': ..., 'weight_decay': 0.0}], "
                "dedicated=dm, ...); for new params, add them to the model and build a new DMuon "
                "(and, for new matrices to go to Muon, a new dedicate_params)."
            )
        super().add_param_group(param_group)

    def register_step_post_hook(self, hook):
        """``torch.optim.Optimizer.register_step_post_hook``; DMuon's refresh stays the last
        per-optimizer post-hook, so ``hook`` runs on the stepped masters (owners) before the
        compute copies and HSDP replicas are refreshed from them: its edits (a clamp, an EMA
        swap, QK-clip) reach every rank. Global post-hooks
        (``torch.optim.optimizer.register_optimizer_step_post_hook``) run after the refresh."""
        handle = super().register_step_post_hook(hook)
        self._optimizer_step_post_hooks.move_to_end(self._refresh.id)
        return handle

    def _after_hooks(self, optimizer=None, args=None, kwargs=None) -> None:
        if self._stepped:
            self._stepped = False
            self.dedicated.after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dedicated.take_back_grads()
        super().zero_grad(set_to_none)
        self._guard.note(())  # the next backward notes its own grads
        self.dedicated.after_zero_grad()

    #: ``torch.amp.GradScaler.step(opt)`` calls ``opt.step(grad_scaler=scaler)`` on every rank
    #: and leaves the skip decision to it (``dmuon/optim/amp.py``).
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """Update owned dedicated params with Muon and all others with AdamW.

        ``grad_scaler``: passed by ``torch.amp.GradScaler.step(opt)`` (and ``ShardedGradScaler``),
        not by the user: the grads are unscaled and the scaler's found-Inf flags agreed over
        every rank (one all_reduce of one element), then every rank steps or every rank skips
        the update (``dmuon/optim/amp.py``); a skipped step leaves params and state unchanged.

        Raises:
            ValueError: a hyper-parameter in ``param_groups`` became invalid (checked on every
                rank before anything else).
            RuntimeError: the plain-tensor grads (DDP, ``rest="replicate"``) were scaled in
                place by one factor after backward, as ``torch.nn.utils.clip_grad_norm_`` does
                (use ``opt.clip_grad_norm_``; ``dmuon/optim/grad_guard.py``), checked on each
                rank before any param changes.
            RuntimeError: called in the middle of a backward pass (see
                ``DedicatedParams.before_step``).
            RuntimeError: a param's ``requires_grad`` changed since DMuon was built
                (``agreement.check_frozen``).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._validate_groups()
        agreement.check_frozen(self.param_groups, self._agreed_requires_grad, self._names)
        skip = grad_scaler is not None and grad_scaler.is_enabled() and amp.found_inf_everywhere(
            self, grad_scaler)
        self.dedicated.take_back_grads()
        self._guard.check()
        self.dedicated.before_step()
        with annotate.phase("optimizer"):
            for group in self.param_groups if not skip else ():
                if group["algorithm"] == "muon":
                    self._muon_group(group)
                else:
                    self._adamw_group(group)
        self._stepped = True  # dedicated.after_step() follows the post-hooks (_after_hooks)
        return loss

    def _validate_groups(self) -> None:
        """Re-check every group's hyper-parameters on every rank (a scheduler or the user may
        have changed them since ``__init__``): an owner-only check would hang the others."""
        for i, group in enumerate(self.param_groups):
            check = validate_muon if group["algorithm"] == "muon" else validate_adamw
            check(group, f"param_groups[{i}].")

    def _muon_group(self, group: dict) -> None:
        """The owned params with a grad, stepped by their placements' kinds
        (``Placement.step``, kinds in ``step_order``, every kind on every rank: a kind whose
        step has collectives meets its peers even with nothing to step here)."""
        hparams = {k: group[k] for k in ("lr", "weight_decay", "momentum", "nesterov",
                                          "ns_coefficients", "ns_steps", "eps", "adjust_lr_fn")}
        # part by part (one handle: one part), each with its own groups; every kind of every
        # part on every rank (the parts are the same on every rank of the mesh)
        for dm in parts_mod.parts_of(self.dedicated):
            mine = set(map(id, dm.params))
            kinds: dict[type, list[torch.Tensor]] = {kind: [] for kind in self._kinds}
            for p in group["params"]:
                if id(p) in mine and id(p) in self._owned and p.grad is not None:
                    kinds[type(dm.placement_of(p))].append(p)
            ctx = StepContext(
                hparams=hparams, momentum_of=self.momentum_of, matrix_shape=self.matrix_shape,
                placement_of=dm.placement_of, launcher=self.launcher,
                groups=dm.groups.model_parallel,
                label=lambda p, dm=dm: (dm.unit_of(p), dm.block_of(p), dm.owner_of(p)))
            for kind, params in kinds.items():
                self.ns_calls += kind.step(ctx, params)

    def _adamw_group(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(self.new_adamw_state(p))
            checkpoint.follow_moves(state, ("exp_avg", "exp_avg_sq"), p)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        _adam_functional(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=True,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

