"""The tracer: hooks that record a training step's tensors, their layouts and their modules'
arithmetic, handed to the writer step by step."""

from __future__ import annotations

import fnmatch
import os
import weakref
from contextlib import contextmanager
from typing import (Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union,
                    cast)

import torch

from .. import arith as _arith
from .._copies import DEFAULT_POOL_BYTES, Copier, HostCopy
from .._summaries import ShardStats, Summarizer
from ..errors import InvalidInputError, TtraceError, UnsupportedLayoutError
from ..report import CheckReport
from .dtensor import (_MeshMap, _dtensor_type, _expressible, _gather_param, _is_dtensor,
                      _local_version, _placement_layout)
from .keep import host_copy, statistics
from .kinds import _kind_of
from .megatron import _megatron_layout
from .mesh import find_mesh
from .microbatches import fold
from .online import OnlineChecker
from .placements import (Layout, Mesh, ModuleLayout, partial,
                         replicate, split)
from .routed import Routing, routing
from .record import (_DTYPES, _StepRecord, _Tap, _alias_key, _base, _device_type,
                     _in_backward, _on_meta, _owns, _param_grad)
from .selection import ModuleSelector, _is_grouped_experts, select_modules
from .sites import _loss_op, _site_op, _SiteState, _site_state
from .writing import StepJob, StepWriter, finish, step_job, summary_job


def _is_pipeline_stage(x: Any) -> bool:
    """Whether ``x`` is a ``torch.distributed.pipelining`` stage (its module, its group and
    forward contexts)."""
    return (not isinstance(x, torch.nn.Module) and isinstance(getattr(x, "submod", None),
                                                             torch.nn.Module)
            and hasattr(x, "register_forward_context") and hasattr(x, "group_rank"))


class Tracer:
    """Records training steps of ``model`` on this rank (see the module docs).

    ``directory``: where traced steps are written (``directory/step{n}``). ``mesh``: a
    :class:`Mesh`, or a ``DeviceMesh`` (default: found from the model's DTensor parameters,
    else data parallel over the ``torch.distributed`` world, else one rank). ``rank``: this
    rank's ttrace global rank (default: from the mesh coordinates or ``torch.distributed``).
    ``axes``: ttrace axis → DeviceMesh dimension name, for meshes whose names are not
    recognized. ``layouts``: per-module tensor-parallel placements of plain tensors.
    ``kinds``: module kinds (``linear``, ``norm``, ``attention``, ``activation``,
    ``residual``, ``embedding``, ``loss``) for modules whose type does not say.
    ``modules``: what to trace. ``every``: trace one step in N. ``dp_dim``: the batch
    dimension of activations (default 0; 1 for models with Megatron layers, whose activations
    are [sequence, batch, hidden], and whose mesh is read from Megatron's parallel state). ``recipe``: a ttrace recipe name for the manifest.
    ``formats``: per-module ``{"quantize", "accumulate", "combine"}`` format names. Declare
    ``"accumulate"`` for a module whose kernel accumulates below FP32 (``"bf16"``, ``"f16"``):
    such sums round one way, so the check then runs no scale or bias test on the trace.
    ``pool_bytes``: the bytes of reused host buffers the copies may hold per device kind
    (pinned on CUDA; default 8 GiB; see :mod:`ttrace._copies` for what happens when it is
    full). ``share``: a tensor handed on unchanged (an output that is the next module's input)
    is copied once (default; on the CPU after comparing contents, on a device by identity
    verified by a checksum when written — see :func:`ttrace.tracer.keep.host_copy`); with
    ``False`` every record is copied and the writer stores equal contents once. What is
    recorded is listed in :mod:`ttrace.tracer.selection`.
    ``sites``: trace functional attention — each call of
    ``torch.nn.functional.scaled_dot_product_attention`` (transformers' and torchtitan's
    attention cores) as an attention site ``{module}.sdpa`` of the module that calls it
    (default: when ``modules`` is not given).
    ``losses``: trace each call of ``torch.nn.functional.cross_entropy`` on [rows, classes]
    logits as a loss site ``{module}.cross_entropy`` (``cross_entropy`` outside every traced
    module): the logits, the targets (stored as floats), the loss and the logits' gradient;
    the checker prices the loss and that gradient through the registry's cross-entropy ops
    (default off).
    ``unsupported``: ``"raise"`` (default) or ``"skip"`` a tensor whose layout the trace
    format cannot express. ``background``: write on a background thread (default: with a
    ``directory``; without one the tracer records from construction until :meth:`write`,
    which then writes before returning).
    ``online``: a reference trace (a step directory, or a trace of steps ``step{n}``): each
    traced step is checked against it by the job's processes together instead of being
    written — no tensor reaches the disk; rank 0 writes ``report.json`` and ``report.txt``
    into ``directory/step{n}``, and every rank gets the report in :attr:`reports` (see
    :mod:`ttrace.tracer.online`). Needs ``torch.distributed`` initialized, one process per
    rank of the mesh; ``online_group`` (default: the world) and ``online_timeout`` (seconds a
    rank waits for the others) say over what and how long.
    ``local_mean_loss``: how each data-parallel rank normalizes its loss. ``True``: it averages
    over its own share of the batch (the usual DDP / FSDP loop), so the gradients flowing
    through activations are dp times those of a reference averaging over the whole batch; they
    are recorded divided by dp (exactly, for dp a power of two). ``False``: normalized by the
    global batch (Megatron's token count), recorded as computed. ``None`` (default): not
    stated — recorded as computed and marked ``"dp_loss": "auto"`` in the manifest, and the
    checker settles which from the reference (the first activation gradients compared both
    ways; its report says which it took).
    A scalar a module returns under data parallelism (a loss module's output) is each rank's
    value over its share of the batch: recorded as a partial sum over dp (divided by dp with
    ``local_mean_loss=True``, so the ranks' mean is judged against the reference's).
    ``microbatches``: the microbatches each step runs as (a pipeline schedule's
    ``n_microbatches``, or gradient accumulation): each module's calls are recorded per
    microbatch and stored concatenated along ``microbatch_dim`` (default ``dp_dim``) in
    microbatch order — what a reference running the whole batch at once holds — and the
    parameter gradients once, accumulated (see :mod:`ttrace.tracer.microbatches`); how each
    microbatch's loss was normalized is settled by the checker. Pipeline parallelism: pass
    this rank's ``torch.distributed.pipelining.PipelineStage`` objects (``model`` a list, one
    per virtual stage): their modules are traced, the pipeline's size and this rank's stage
    read from them, and the forwards their schedule runs only to infer shapes before the
    first microbatch (``is_metadata_inference``) are not recorded. Or pass the model parts
    themselves (torchtitan's ``model_parts``; their module names must not collide, their
    root modules are not traced) with ``stages`` (the pipeline's size) and ``stage`` (this
    rank's coordinate along it) — found from a device mesh with a ``pp`` dimension when it is
    given or its parameters' mesh has one; default: the pipeline dimension outermost, stage =
    rank // (world / stages); a schedule's shape inference on the first step then runs the
    parts once more, which the tracer cannot tell from a microbatch (it refuses the step).
    The trace's mesh is then one stage's, and each stage's ranks write their own modules.
    ``experts``: expert parallelism — patterns (``fnmatch``, e.g. ``["layers.*.moe.experts.*"]``)
    naming the expert modules, each owned by the data-parallel rank that holds and calls it:
    its tensors (and its submodules', its parameters' gradients) are the owner's alone, the
    whole tensor — an expert's input is the tokens every rank routed to it — and written
    ``owned`` along dp (no other rank holds an entry of them). The checker aligns them with
    the reference's expert when each expert's rows are its tokens in batch order (ranks
    holding contiguous shares of the batch, the received tokens in source-rank order: the
    dispatch of Megatron-LM, torchtitan and DeepSeek); an expert that received other tokens
    than the reference routed to it is reported with the counts.
    """

    def __init__(
        self,
        model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
        directory: Optional[Union[str, "os.PathLike[str]"]] = None,
        *,
        mesh: Any = None,
        rank: Optional[int] = None,
        axes: Optional[Dict[str, str]] = None,
        layouts: Optional[Dict[str, ModuleLayout]] = None,
        kinds: Optional[Dict[str, str]] = None,
        modules: ModuleSelector = None,
        every: int = 1,
        dp_dim: Optional[int] = None,
        recipe: Optional[str] = None,
        formats: Optional[Dict[str, dict]] = None,
        unsupported: str = "raise",
        background: Optional[bool] = None,
        local_mean_loss: Optional[bool] = None,
        fsync: bool = False,
        sites: Optional[bool] = None,
        losses: bool = False,
        pool_bytes: int = DEFAULT_POOL_BYTES,
        summaries: bool = False,
        share: bool = True,
        online: Optional[Union[str, "os.PathLike[str]"]] = None,
        online_group: Any = None,
        online_timeout: Optional[float] = None,
        microbatches: int = 1,
        microbatch_dim: Optional[int] = None,
        stages: Optional[int] = None,
        stage: Optional[int] = None,
        experts: Optional[Sequence[str]] = None,
    ) -> None:
        if every < 1:
            raise InvalidInputError(f"every must be at least 1 (got {every})", "InvalidParameter")
        if microbatches < 1:
            raise InvalidInputError(f"microbatches must be at least 1 (got {microbatches})",
                                    "InvalidParameter")
        if microbatches > 1 and summaries:
            raise InvalidInputError("summaries=True records statistics, which microbatches "
                                    "cannot be concatenated from: trace their tensors",
                                    "InvalidParameter")
        if isinstance(experts, str):
            raise InvalidInputError("experts must be a list of module-name patterns "
                                    f"(got the string {experts!r})", "InvalidParameter")
        #: Patterns (fnmatch) of the expert modules, owned by the data rank that calls them.
        self.experts: List[str] = list(experts or [])
        if self.experts and microbatches > 1:
            raise InvalidInputError(
                "experts= with microbatches > 1 is not supported yet: an expert's "
                "microbatches gather tokens of every rank each, which concatenated are not "
                "the reference's token order", "InvalidParameter")
        if losses and microbatches > 1:
            raise InvalidInputError(
                "losses=True with microbatches > 1 is not supported yet: each microbatch's "
                "loss is a mean over its own rows, not the reference's", "InvalidParameter")
        if self.experts and summaries:
            raise InvalidInputError("summaries=True does not record experts yet: trace their "
                                    "tensors", "InvalidParameter")
        if self.experts and online is not None:
            raise InvalidInputError("online= does not check experts yet: write the steps and "
                                    "run ttrace check on them", "InvalidParameter")
        if stage is not None and stages is None:
            raise InvalidInputError("stage= needs stages= (the pipeline's size)",
                                    "InvalidParameter")
        if pool_bytes < 0:
            raise InvalidInputError(f"pool_bytes must be non-negative (got {pool_bytes})",
                                    "InvalidParameter")
        if summaries and directory is None:
            raise InvalidInputError("summaries=True needs a directory: Tracer(model, directory, "
                                    "summaries=True)", "InvalidParameter")
        if online is not None and (directory is None or summaries):
            raise InvalidInputError(
                "online= needs a directory (for the reports) and no summaries: "
                "Tracer(model, directory, online=reference)", "InvalidParameter")
        if unsupported not in ("raise", "skip"):
            raise InvalidInputError(
                f"unsupported must be 'raise' or 'skip' (got {unsupported!r})", "InvalidParameter"
            )
        # DistributedDataParallel wraps the model as `.module`: trace the model itself, so its
        # module names are the reference's.
        given: List[Any] = [model] if isinstance(model, torch.nn.Module) else list(model)
        #: Pipeline stages whose shape-inference forwards are told apart (see the docs).
        self._pipeline_stages: List[Any] = [p for p in given if _is_pipeline_stage(p)]
        parts: List[Any] = given
        if self._pipeline_stages:
            if len(self._pipeline_stages) != len(given):
                raise InvalidInputError("model: pipeline stages and modules mixed; pass the "
                                        "stages alone", "InvalidParameter")
            first = self._pipeline_stages[0]
            parts = [s.submod for s in self._pipeline_stages]
            if stages is None:
                stages, stage = int(first.group_size), int(first.group_rank)
        #: Whether a pipeline stage is running a shape-inference forward (not recorded).
        self._probing = False
        self._probe_handles: List[Any] = []
        if not parts or not all(isinstance(p, torch.nn.Module) for p in parts):
            raise InvalidInputError("model must be a torch.nn.Module or a non-empty list of "
                                    "them (the model parts of one pipeline rank)",
                                    "InvalidParameter")
        for k, part in enumerate(parts):
            while type(part).__name__ == "DistributedDataParallel" and hasattr(part, "module"):
                part = cast(torch.nn.Module, part.module)
            parts[k] = part
        model = parts[0] if len(parts) == 1 else torch.nn.ModuleList(parts)
        self.model = model
        self.microbatches = microbatches
        self.directory = os.fspath(directory) if directory is not None else None
        self.axes = dict(axes or {})
        self.kinds = dict(kinds or {})
        self.formats = dict(formats or {})
        self.recipe = recipe
        self.dp_dim = 0 if dp_dim is None else dp_dim
        self.every = every
        self.unsupported = unsupported
        self.local_mean_loss = local_mean_loss
        self.fsync = fsync
        self._dtensor = _dtensor_type()
        named: Dict[str, torch.nn.Module] = {}
        for part in parts:
            for n, m in part.named_modules():
                if (n in named and named[n] is not m and n
                        and (not any(True for _ in m.children())
                             or any(True for _ in m.parameters(recurse=False)))):
                    # Containers (the parts' own `layers`) may share a name; modules that
                    # compute may not.
                    raise InvalidInputError(
                        f"module {n!r} is in two model parts: a pipeline rank's parts must "
                        "hold different modules", "InvalidParameter")
                named.setdefault(n, m)
        self._named = named
        self.layouts: Dict[str, ModuleLayout] = {}
        for n, m in named.items():
            ml = _megatron_layout(m, n)
            if ml is not None:
                self.layouts[n] = ml
        self._megatron = bool(self.layouts)
        if dp_dim is None and self._megatron:
            # Megatron's activations are [sequence, batch, hidden]; elsewhere the batch leads.
            self.dp_dim = 1
        self.microbatch_dim = self.dp_dim if microbatch_dim is None else microbatch_dim
        self.layouts.update(layouts or {})
        self.names = select_modules(named, modules)
        if self.experts:
            matched = [n for n in named if n and any(fnmatch.fnmatchcase(n, p)
                                                     for p in self.experts)]
            if not matched:
                raise InvalidInputError(f"experts: no module matches {self.experts!r}",
                                        "UnknownName")
            if modules is None:
                # The layers routing tokens to the experts and the experts themselves are
                # traced too: a bug in the dispatch or the combine is then found where it is
                # born (the MoE layer's output), not in the layer after it.
                routing = {n.rpartition(".")[0].rpartition(".")[0] for n in matched}
                extra = [n for n in named if n in routing or n in matched]
                self.names = [n for n in named if n in set(self.names) | set(extra)]
        unknown = [n for n in list(layouts or {}) + list(self.kinds) if n not in named]
        if unknown:
            raise InvalidInputError(f"no module named {unknown[0]!r} in the model", "UnknownName")
        #: Whether functional attention (``scaled_dot_product_attention`` calls) is traced
        #: as attention sites inside the modules that call it.
        self.sites = modules is None if sites is None else sites
        #: Whether functional cross-entropy calls are traced as loss sites.
        self.losses = losses
        self._sites: "set[str]" = set()
        #: Per attention call (``{module}.sdpa``, ``….sdpa#1``), the registry op it computes
        #: (``None``: a mask, dropout or another scale; or steps whose calls disagree).
        self._site_ops: Dict[str, Optional[str]] = {}
        self._stack: List[str] = []
        self._site_state: Optional[_SiteState] = None
        self._mesh_maps: Dict[int, _MeshMap] = {}
        #: Why the device mesh cannot be placed, if it cannot (reported per tensor).
        self.mesh, self.rank, self._mesh_error, pipe = find_mesh(
            model, named, self._dtensor, self.axes, self._megatron, mesh, rank,
            None if stages is None else (stages, stage)
        )
        #: (pipeline stages, this rank's stage).
        self.stages, self.stage = pipe
        if online is not None and self.stages > 1:
            # The online check hands shards between processes by their rank in the mesh,
            # which a pipeline's stages share.
            raise InvalidInputError(
                "online= does not check a pipelined run yet: write its steps "
                "(Tracer(stages, directory, microbatches=M)) and run ttrace check on them",
                "InvalidParameter")
        if self.stages > 1 or len(parts) > 1:
            # A stage's part makes no root call of the model's: its root is not traced.
            self.names = [n for n in self.names if n != ""]
        if self.experts and self.mesh.cp > 1:
            raise InvalidInputError("experts= under context parallelism is not supported yet "
                                    "(experts are owned along dp)", "InvalidParameter")
        #: The traced grouped-experts modules (found once: their calls may split by expert).
        self._grouped: Set[str] = {n for n in self.names if _is_grouped_experts(self._named[n])}
        #: The experts of grouped-experts modules recorded expert by expert (see _put).
        self._routed_names: Set[str] = set()
        #: Per module name: whether it is an expert or inside one (see :meth:`_owned`).
        self._owned_cache: Dict[str, bool] = {}
        #: Tensors left out because their layout cannot be expressed: (id, reason).
        self.skipped: List[Tuple[str, str]] = []
        self.steps = 0
        self.last_directory: Optional[str] = None
        self._s = _StepRecord()
        #: Host copies: pooled buffers, asynchronous on CUDA (see :mod:`ttrace._copies`).
        self._copier = Copier(pool_bytes)
        self._share = share
        #: Summaries only (``summaries=True``): statistics computed on the device per tensor.
        self._summarizer = Summarizer() if summaries else None
        #: Online checking (``online=``): the checker, and each checked step's report.
        self._online = (OnlineChecker(os.fspath(online), group=online_group,
                                      timeout=online_timeout)
                        if online is not None else None)
        self.reports: Dict[int, CheckReport] = {}
        self._handles: List[Any] = []
        #: The rank naming this process's files: its global rank (the stage's ranks after
        #: the earlier stages').
        self.file_rank = self.stage * self.mesh.world() + self.rank
        self._writer = StepWriter(
            self.file_rank, fsync,
            background if background is not None else directory is not None
        )
        self._closed = False
        for ps in self._pipeline_stages:
            self._probe_handles.append(ps.register_forward_context(self._probe_context))
        if directory is None:
            # No steps to delimit: record from now until write().
            self.attach()

    # -- configuration ----------------------------------------------------------------------

    # -- recording ----------------------------------------------------------------------------

    @contextmanager
    def step(self) -> Iterator["Tracer"]:
        """Trace the training step run inside the block (when this step is one in ``every``);
        parameter gradients are read as the block ends, and the step is handed to the writer."""
        if self._closed:
            raise InvalidInputError("the tracer is closed", "InvalidParameter")
        if self.directory is None:
            raise InvalidInputError(
                "Tracer(model, directory) is needed for step(); or call write(dir)",
                "InvalidParameter",
            )
        n = self.steps
        self.steps += 1
        traced = n % self.every == 0
        if traced:
            self.attach()
        try:
            yield self
        finally:
            if traced:
                self.detach()
        if traced:
            if self._summarizer is not None:
                self._hand_summaries(n)
            elif self._online is not None:
                self._check_online(n)
            else:
                self.write(os.path.join(self.directory, f"step{n}"))

    def attach(self) -> None:
        """Register the hooks (``step()`` does this for traced steps)."""
        if self._handles:
            return
        self._drop_step()
        if self.sites:
            # Which module is running (for naming the functional attention sites inside it),
            # and the mode that sees the functional calls (thread-local, only while attached).
            # The root counts ("" names no parent), so that a call it makes is known as this
            # tracer's among several attached on the thread.
            for n, m in self._named.items():
                self._handles.append(m.register_forward_pre_hook(self._push(n)))
                self._handles.append(m.register_forward_hook(self._pop(n), always_call=True))
            self._site_state = _site_state()
            self._site_state.attach(self)
        for n in self.names:
            m = self._named[n]
            # Appended: after the pre-hooks of the module's parallel style, so the inputs are
            # recorded (and tapped) as the module receives them.
            self._handles.append(
                m.register_forward_pre_hook(self._input_hook(n), with_kwargs=True)
            )
            # prepend=True: run before a DTensor output hook converts the output to a local
            # tensor, so the placement is still known.
            self._handles.append(
                m.register_forward_hook(self._forward_hook(n), prepend=True, with_kwargs=True)
            )
            # Appended: the outputs as the caller receives them, after any DTensor conversion;
            # their gradients are tapped there.
            self._handles.append(m.register_forward_hook(self._final_hook(n)))

    @contextmanager
    def _probe_context(self, info: Any) -> Iterator[None]:
        """Around every forward a pipeline stage runs: marks its shape-inference probes."""
        before = self._probing
        self._probing = bool(getattr(info, "is_metadata_inference", False))
        try:
            yield
        finally:
            self._probing = before

    def detach(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._site_state is not None:
            # From the thread that attached (the mode stack is per thread).
            state, self._site_state = self._site_state, None
            state.detach(self)
        self._stack = []

    def _call_name(self, base: str) -> str:
        """The name this call of ``base`` records under: ``base``, then ``base#1``, … for
        further calls in the step; a recomputation inside the backward pass (activation
        checkpointing) counts apart and reuses the names of the calls it repeats."""
        counter = self._s.recomputed if _in_backward() else self._s.calls
        calls = counter.get(base, 0)
        counter[base] = calls + 1
        name = base if calls == 0 else f"{base}#{calls}"
        self._s.current[base] = name
        return name

    def _push(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self._stack.append(name)
        return hook

    def _pop(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self._stack and self._stack[-1] == name:
                self._stack.pop()
        return hook

    def _attention_site(self, func: Callable[..., Any], args: Tuple[Any, ...],
                        kwargs: Dict[str, Any]) -> Any:
        """Record one call of ``scaled_dot_product_attention`` as the attention site
        ``{module}.sdpa`` of the module it runs in: query, key, value (and a floating-point
        mask) as its inputs, their gradients tapped, the output and its gradient."""
        if self._probing or _on_meta(args, kwargs):
            return func(*args, **kwargs)
        parent = self._stack[-1] if self._stack else ""
        base = f"{parent}.sdpa" if parent else "sdpa"
        name = self._call_name(base)
        self._sites.add(name)
        self._sites.add(base)
        keys = ["query", "key", "value", "attn_mask"]
        values = list(args[:4]) + [kwargs.get(k) for k in keys[len(args[:4]):]]
        op = _site_op(args, kwargs)
        self._site_ops[name] = op if self._site_ops.get(name, op) == op else None
        device = next((v.device.type for v in values if isinstance(v, torch.Tensor)), "cpu")
        if name not in self._s.arith:
            self._s.arith[name] = _arith.module_settings(device)
        recorded = [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
        for i, v in enumerate(recorded):
            self._record(name, "fwd.input", i, v)
        self._s.tapped[name] = False
        if torch.is_grad_enabled():
            tapped = {id(v): self._tap(name, i, v) for i, v in enumerate(recorded)}
            values = [tapped.get(id(v), v) if isinstance(v, torch.Tensor) else v
                      for v in values]
        new_args = tuple(values[:len(args[:4])]) + tuple(args[4:])
        new_kwargs = dict(kwargs)
        for k, v in zip(keys[len(args[:4]):], values[len(args[:4]):]):
            if k in kwargs:
                new_kwargs[k] = v
        out = func(*new_args, **new_kwargs)
        self._record(name, "fwd.output", 0, out)
        if isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled():
            out.register_hook(self._output_grad(name, 0))
        return out

    def _loss_site(self, func: Callable[..., Any], args: Tuple[Any, ...],
                   kwargs: Dict[str, Any]) -> Any:
        """Record one call of ``cross_entropy`` on [rows, classes] logits as the loss site
        ``{module}.cross_entropy``: the logits (their gradient tapped) and the targets as its
        inputs (the targets stored as float32: class indices, exact below 2^24), the loss and
        its arriving gradient."""
        logits = args[0] if args else kwargs.get("input")
        target = args[1] if len(args) > 1 else kwargs.get("target")
        if (not self.losses or self._probing or _on_meta(args, kwargs)
                or not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor)
                or logits.dim() != 2 or not logits.is_floating_point()
                or target.is_floating_point() or target.dim() != 1):
            return func(*args, **kwargs)
        parent = self._stack[-1] if self._stack else ""
        base = f"{parent}.cross_entropy" if parent else "cross_entropy"
        name = self._call_name(base)
        self._sites.add(name)
        self._sites.add(base)
        op = _loss_op(args, kwargs, logits.shape[-1])
        self._site_ops[name] = op if self._site_ops.get(name, op) == op else None
        if name not in self._s.arith:
            self._s.arith[name] = _arith.module_settings(logits.device.type)
        self._record(name, "fwd.input", 0, logits)
        self._record(name, "fwd.input", 1, target.detach().to(torch.float32))
        self._s.tapped[name] = False
        if torch.is_grad_enabled() and logits.requires_grad:
            logits = self._tap(name, 0, logits)
        new_args = (logits,) + tuple(args[1:]) if args else args
        new_kwargs = dict(kwargs)
        if not args:
            new_kwargs["input"] = logits
        out = func(*new_args, **new_kwargs)
        self._record(name, "fwd.output", 0, out)
        if isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled():
            out.register_hook(self._output_grad(name, 0))
        return out

    def _layout(self, name: str, role: str, i: int, t: torch.Tensor,
                param: Optional[str] = None) -> Layout:
        ml = self.layouts.get(_base(name))
        if param is not None:
            tp = ml.params.get(param, replicate()) if ml else replicate()
        else:
            tp = ml.pick(role, i) if ml else replicate()
        if tp.is_split and tp.dim < 0:
            tp = split(tp.dim + t.dim(), tp.groups)
        if tp.is_split and not 0 <= tp.dim < max(t.dim(), 1):
            raise InvalidInputError(
                f"module {name!r}: split dim out of range for a {t.dim()}-d tensor",
                "InvalidParameter",
            )
        if self.mesh.tp == 1:
            tp = replicate()
        dp = replicate()
        if self.mesh.dp > 1 and param is None and t.dim() > self.dp_dim:
            dp = split(self.dp_dim)
        return Layout(dp=dp, tp=tp)

    def _mesh_of(self, device_mesh: Any) -> _MeshMap:
        """How the dimensions of a tensor's own device mesh map onto ttrace's axes (unusable
        when the whole mesh the tracer places its ranks on is)."""
        key = id(device_mesh)
        mm = self._mesh_maps.get(key)
        if mm is None:
            mm = self._mesh_maps[key] = _MeshMap(device_mesh, self.axes, self._dp_group())
            if mm.error is None and self._mesh_error is not None:
                mm.error = self._mesh_error
        return mm

    def _dp_group(self) -> Optional[List[int]]:
        """This rank's data-parallel group as global ranks (ttrace's rank r = (d·cp + c)·tp +
        t is the global rank when the tracer holds every rank: no pipeline stages)."""
        if self.stages > 1 or self.mesh.dp < 2:
            return None
        cp_tp = self.rank % (self.mesh.cp * self.mesh.tp)
        return sorted(d * self.mesh.cp * self.mesh.tp + cp_tp for d in range(self.mesh.dp))

    def _local_layout(self, tid: str, t: torch.Tensor) -> Optional[Layout]:
        """The layout of a plain tensor made by ``DTensor.to_local()`` (its autograd node keeps
        the DTensor's placements), or of the local shard of a DTensor seen before."""
        spec = getattr(t.grad_fn, "dtensor_spec", None)
        if spec is not None:
            mm = self._mesh_of(spec.mesh)
            layout = _placement_layout(tid, spec.placements, spec.mesh, tuple(spec.shape), mm)
            return self._uncovered(layout, mm, t.dim())
        key = _alias_key(t)
        hit = self._s.alias.get(key) if key is not None else None
        # Only while the tensor first seen there lives and still owns that memory (torch can
        # free a live tensor's storage: then the address may hold another tensor).
        return hit[1] if hit is not None and _owns(hit[0](), t) else None

    def _uncovered(self, layout: Layout, mm: _MeshMap, ndim: int) -> Layout:
        """A non-parameter DTensor's layout completed along the axes its device mesh does not
        cover (TP on ``mesh["tp"]`` of a 2-D mesh whose dp dimension splits the batch as plain
        data): a split of the batch dimension (``dp_dim``) for dp, replication otherwise —
        guesses, for the checker to settle."""
        missing = [a for a in ("dp", "cp", "tp")
                   if a not in {x for _, x, _ in mm.placed()} and getattr(self.mesh, a) > 1]
        if not missing:
            return layout
        if "dp" in missing and ndim > self.dp_dim:
            layout = layout.with_("dp", split(self.dp_dim))
        return layout.with_guess(*missing)

    def _remember(self, owner: torch.Tensor, t: torch.Tensor, layout: Layout) -> None:
        key = _alias_key(t)
        if key is not None:
            self._s.alias[key] = (weakref.ref(owner), layout)

    def _derived(self, tid: str, name: str, role: str, i: int, t: torch.Tensor,
                 inherit: Optional[dict]) -> Tuple[Optional[Layout], List[str]]:
        """The layout of a plain tensor of a module without declared layouts, derived from
        DTensors of this step (see the module docs), and the axes along which it is only a
        guess (the gradient of a forward tensor whose layout was guessed)."""
        if _base(name) in self.layouts:
            return None, []
        hit = self._local_layout(tid, t)
        if hit is not None:
            return hit, []
        if role == "grad.output":
            key = (name, "fwd.output", i)
            fwd = self._s.final.get((name, i))
        elif role == "grad.input":
            key = (name, "fwd.input", i)
            fwd = self._s.forward.get(key)
        else:
            fwd = None
        if fwd is not None and fwd[0] == tuple(t.shape):
            return fwd[1].grad(), self._s.guesses.get(key, [])
        if role == "fwd.output" and inherit is not None and inherit["shape"] == tuple(t.shape):
            return inherit["layout"], []
        return None, []

    def _record(self, name: str, role: str, i: int, t: Any, param: Optional[str] = None,
                inherit: Optional[dict] = None, info: Optional[dict] = None) -> Optional[Layout]:
        """Record one tensor; returns its layout when it was derived from a DTensor."""
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return None
        tid = f"{name}.{param}|param_grad" if param is not None else f"{name}|{role}.{i}"
        declared = self.layouts.get(_base(name))
        if declared is not None and declared.swap_outputs and role in ("fwd.output",
                                                                      "grad.output"):
            t = t.transpose(*declared.swap_outputs)
        derived = None
        guessed: List[str] = []
        scalar_mean = False
        #: Axes along which a module hands its caller a partial sum as a plain tensor.
        unreduced: List[str] = []
        try:
            if self._dtensor is not None and isinstance(t, self._dtensor):
                dt = cast(Any, t)
                mm = self._mesh_of(dt.device_mesh)
                if param is not None:
                    dt = _gather_param(dt, mm if mm.error is None else None)
                layout = _placement_layout(tid, dt.placements, dt.device_mesh, tuple(dt.shape),
                                           mm)
                if param is None:
                    layout = self._uncovered(layout, mm, dt.dim())
                    if self.mesh.cp > 1 and layout.cp.is_split:
                        # Context parallelism places the sequence as Shard(seq) on the cp mesh
                        # in whatever order its load balancer put the tokens (torch's CP:
                        # head-tail chunks for causal attention): the order is settled from
                        # the values.
                        layout = layout.with_guess("cp")
                local = dt.to_local()
                derived = layout
                self._remember(getattr(dt, "_local_tensor", local), local, layout)
            else:
                local = t
                derived, guessed = (self._derived(tid, name, role, i, t, inherit)
                                    if param is None else (None, []))
                layout = derived if derived is not None else self._layout(name, role, i, t, param)
                if (role == "fwd.output" and derived is not None
                        and getattr(t.grad_fn, "dtensor_spec", None) is not None):
                    # A DTensor's Partial() made local and handed on with no reduction: merged
                    # as the sum it is, but the caller's plain code uses one rank's addend.
                    unreduced = derived.partial_axes()
                if derived is None and self.mesh.world() > 1:
                    # Neither a DTensor, nor declared, nor derived from one: a guess the
                    # checker settles from the shapes. Under data parallelism the batch
                    # dimension of a plain tensor is a guess too (dp_dim), even where its
                    # tensor-parallel placement is declared.
                    guessed = [a for a, unknown in (("dp", self.mesh.dp > 1 and param is None),
                                                    ("cp", self.mesh.cp > 1 and param is None),
                                                    ("tp", self.mesh.tp > 1
                                                     and _base(name) not in self.layouts))
                               if unknown]
                if derived is not None and derived.guessed:
                    guessed = sorted(set(guessed) | set(derived.guessed))
                if guessed:
                    # Not handed on as known (the gradient of this tensor is a guess too).
                    derived = None
                if param is None and derived is None and _base(name) in self.layouts:
                    # A declared layout (Megatron's layers): the modules this tensor is handed
                    # to next find it by its memory — with its cp placement still a guess
                    # under context parallelism (the sequence's chunks are no layer's).
                    derived = layout.with_guess("cp") if "cp" in guessed else layout
                    self._remember(t, t, derived)
                if t.dim() == 0 and self.mesh.dp * self.mesh.cp > 1 and param is None:
                    # A scalar under data (or context) parallelism is each rank's own value,
                    # a loss over its share of the batch: the reference's is their sum when
                    # each is normalized by the global count, their mean when each averages
                    # its own share (divided by dp·cp here with local_mean_loss=True, by the
                    # checker when it settles an unstated normalization). Its gradient is the
                    # backward's seed, the same on every rank.
                    fwd = role.startswith("fwd.")
                    for a in ("dp", "cp"):
                        if getattr(self.mesh, a) > 1:
                            layout = layout.with_(a, partial() if fwd else replicate())
                    guessed = [a for a in guessed if a not in ("dp", "cp")]
                    derived = None
                    scalar_mean = fwd and self.local_mean_loss is True
        except UnsupportedLayoutError as e:
            if self.unsupported == "skip":
                self.skipped.append((tid, str(e)))
                return None
            raise
        if local.dtype not in _DTYPES:
            raise InvalidInputError(
                f"tensor {tid!r}: dtype {local.dtype} cannot be stored", "UnknownFormat"
            )
        owned = self._owned(_base(name))
        if owned:
            # An expert on this data rank: it holds the expert whole (the tokens every rank
            # routed to it, a parameter no other rank has), no other data rank holds it.
            layout = layout.known().with_("dp", replicate())
            guessed = [a for a in guessed if a != "dp"]
            derived = None
        # With local_mean_loss=True, an activation gradient in parts along the data ranks
        # (dp split; under context parallelism every one, its cp placement mostly a guess) is
        # dp·cp times the reference's: recorded divided.
        data = self.mesh.dp * self.mesh.cp
        scaled = scalar_mean or (self.local_mean_loss is True and data > 1
                                 and role.startswith("grad.") and param is None
                                 and (layout.dp.is_split or owned
                                      or (self.mesh.cp > 1 and t.dim() > 0)))
        # The same tensor handed from one module to the next (an output that is the next
        # module's input: same memory, shape, strides and version while the first holder
        # lives) is copied and stored once, both ids naming it — verified by contents (see
        # keep.host_copy).
        copy: Any
        scale = 1.0 / data if scaled else None
        if self._summarizer is not None:
            copy = statistics(self._s, self._summarizer, t, local, scale)
        else:
            try:
                copy = host_copy(self._s, self._copier, t, local, scale, tid, name, self._share)
            except RuntimeError as e:
                # A tensor whose storage torch already released cannot be read.
                why = f"tensor {tid!r} cannot be read ({e})"
                if self.unsupported == "skip":
                    self.skipped.append((tid, why))
                    return None
                raise TtraceError(why, "Storage") from None
        if tid not in self._s.records:
            self._s.order.append(tid)
        self._s.records[tid] = copy
        if layout.guessed:
            guessed = sorted(set(guessed) | set(layout.guessed))
            layout = layout.known()
        module_info = self._module_info(name)
        if info:
            module_info = {**info, **(module_info or {})}  # declared formats win
        if unreduced:
            module_info = {**(module_info or {}), "unreduced": unreduced}
        settings = self._s.arith.get(name)
        if settings:
            module_info = {**settings, **(module_info or {})}
        self._s.meta[tid] = {"layout": layout, "module": module_info,
                             "guessed": guessed, "owned": "dp" if owned else None}
        if param is None:
            self._s.forward[(name, role, i)] = (tuple(local.shape), layout)
            if guessed:
                self._s.guesses[(name, role, i)] = guessed
        return derived

    def _routing(self, base: str, module: torch.nn.Module,
                 inputs: List[Any]) -> Optional[Routing]:
        """How a call of a grouped-experts module given its token counts splits its rows by
        expert (``None`` for any other call); see :mod:`ttrace.tracer.routed`."""
        if base not in self._grouped:
            return None
        dp_coord = self.rank // (self.mesh.cp * self.mesh.tp)
        try:
            route = routing(module, inputs, self.mesh.dp, dp_coord, self._dtensor, base)
            if route is not None and (self.microbatches > 1 or self._summarizer is not None
                                      or self._online is not None):
                # As for experts=: an expert's microbatches concatenated are not the
                # reference's token order; summaries and the online check hold no experts.
                raise UnsupportedLayoutError(
                    f"module {base!r}: grouped experts called with token counts are recorded "
                    "expert by expert, which microbatches, summaries and the online check do "
                    "not support yet", "Layout")
            return route
        except UnsupportedLayoutError as e:
            if self.unsupported != "skip":
                raise
            self.skipped.append((base, str(e)))
            return Routing(0, -1, (), 0)  # records none of the call's tensors

    def _put(self, name: str, role: str, i: int, t: Any) -> None:
        """Record a tensor of a module call: whole, or — a grouped-experts call given its
        token counts — its rows expert by expert, as ``{module}.{e}`` (only the tensors of its
        rows: the rows input, the outputs of as many rows, their gradients)."""
        route = self._s.routed.get(name)
        if route is None:
            self._record(name, role, i, t)
            return
        if (not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != route.rows
                or (role.endswith("input") and i != route.rows_input)):
            return
        base, sep, call = name.partition("#")
        for e, piece in route.pieces(t):
            expert = f"{base}.{e}{sep}{call}"
            if name in self._s.arith:
                self._s.arith.setdefault(expert, self._s.arith[name])
            self._routed_names.add(f"{base}.{e}")
            self._record(expert, role, i, piece)

    def _put_expert_grads(self, name: str, pname: str, grad: torch.Tensor, info: dict,
                          route: Routing, seen: Set[str]) -> Optional[List[str]]:
        """The gradient of a grouped-experts module's stacked parameter recorded expert by
        expert (``{module}.{e}.{pname}``, the experts this rank holds); their ids. ``None``
        for a parameter not stacked by expert (its first dimension is not the experts'): the
        caller records it whole."""
        local = len(route.experts)
        if not local:
            return []  # skipped (see _routing)
        if self._dtensor is not None and isinstance(grad, self._dtensor):
            dt = cast(Any, grad)
            if dt.dim() == 0 or int(dt.shape[0]) != route.total:
                return None
            held = dt.to_local()
            if tuple(held.shape) != (local, *tuple(dt.shape)[1:]):
                # Sharded again (FSDP over the experts): gathered, in the collective every
                # rank makes here in the same order.
                whole = dt.full_tensor()
                held = whole[route.experts[0][0]:route.experts[0][0] + local]
        else:
            held = grad
        if held.dim() == 0 or held.shape[0] != local:
            return None
        ids = []
        for j, (e, _, _) in enumerate(route.experts):
            expert = f"{name}.{e}"
            self._routed_names.add(expert)
            self._record(expert, "param", 0, held[j], param=pname, info=info)
            tid = f"{expert}.{pname}|param_grad"
            if tid not in seen and tid in self._s.records:
                seen.add(tid)
                ids.append(tid)
        return ids

    def _owned(self, name: str) -> bool:
        """Whether the module ``name`` is an expert (``experts=``, or one expert of a
        grouped-experts module given token counts) or inside one, under data parallelism (a
        one-rank run holds every expert, as a reference does)."""
        if self.mesh.dp > 1 and name in self._routed_names:
            return True
        if not self.experts or self.mesh.dp == 1:
            return False
        hit = self._owned_cache.get(name)
        if hit is None:
            parts = name.split(".")
            prefixes = [".".join(parts[:k]) for k in range(1, len(parts) + 1)]
            hit = any(fnmatch.fnmatchcase(p, pat) for p in prefixes for pat in self.experts)
            self._owned_cache[name] = hit
        return hit

    def _kind(self, name: str) -> Optional[str]:
        if name in self.kinds:
            return self.kinds[name]
        if name in self._sites:
            return "loss" if name.endswith("cross_entropy") else "attention"
        module = self._named.get(name)
        # One expert of a grouped-experts module (see _put): no module of its own.
        return _kind_of(module) if module is not None else None

    def _module_info(self, name: str) -> Optional[dict]:
        op = self._site_ops.get(name)
        name = _base(name)
        kind = self._kind(name)
        info = {"kind": kind} if kind is not None else {}
        if op is not None:
            info["op"] = op
        info.update(self.formats.get(name, {}))
        return info or None

    def _input_hook(self, base: str) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
            # A module called again in the same step (one activation instance used twice, a
            # rotary module applied to queries and keys) is recorded under `name#k` for its
            # k-th further call, so no call's tensors overwrite another's.
            # A forward run again inside the backward pass is activation checkpointing's
            # recomputation of calls already seen: it reuses their names (counted apart), so
            # its tensors and the gradients it produces land on the forward's ids.
            if self._probing or _on_meta(args, kwargs):
                # Shape inference (a pipeline stage's first step): not a call of the step.
                return args, kwargs
            name = self._call_name(base)
            if name not in self._s.arith:
                self._s.arith[name] = _arith.module_settings(_device_type(module, args, kwargs))
            # Recorded (copied) before the module runs: it may modify them in place.
            inherit = None
            # Keyword tensors (hidden_states=x, as Hugging Face models pass them) follow the
            # positional ones, in the order given.
            keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
            inputs = list(args) + [kwargs[k] for k in keys]
            route = self._routing(base, module, inputs)
            if route is not None:
                self._s.routed[name] = route
            for i, a in enumerate(inputs):
                if route is not None:
                    self._put(name, "fwd.input", i, a)
                    continue
                derived = self._record(name, "fwd.input", i, a)
                if derived is not None and inherit is None and not _is_dtensor(a, self._dtensor):
                    inherit = {"shape": tuple(a.shape), "layout": derived}
            self._s.inherit[name] = inherit
            self._s.tapped[name] = False
            if not torch.is_grad_enabled():
                return args, kwargs
            tapped = [self._tap(name, i, a) for i, a in enumerate(inputs)]
            kwargs = dict(kwargs)
            for k, t in zip(keys, tapped[len(args):]):
                kwargs[k] = t
            return tuple(tapped[:len(args)]), kwargs
        return hook

    def _tap(self, name: str, i: int, a: Any) -> Any:
        """``a`` as the module should receive it: through a :class:`_Tap` recording the
        gradient that flows back to it through the module (when it needs one)."""
        if not isinstance(a, torch.Tensor) or not a.is_floating_point() or not a.requires_grad:
            return a
        record = self._s
        self._s.tapped[name] = True

        def got(g: torch.Tensor) -> None:
            if self._s is record:  # the step is still being recorded
                self._put(name, "grad.input", i, g)
                # Parameter gradients are read when the step ends; remember where they belong.
                record.order.append(("params", _base(name)))

        return _Tap.apply(a, got)

    def _forward_hook(self, base: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                 output: Any) -> None:
            if self._probing or _on_meta((output,), kwargs):
                return
            name = self._s.current.get(base, base)
            inherit = self._s.inherit.get(name)
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for i, o in enumerate(outs):
                if name in self._s.routed:
                    self._put(name, "fwd.output", i, o)
                    continue
                if _is_dtensor(o, self._dtensor) and not _expressible(o):
                    # Recorded as the caller receives it (after the module's parallel style
                    # redistributes it), by the appended hook.
                    self._s.deferred.add((name, i))
                    continue
                derived = self._record(name, "fwd.output", i, o, inherit=inherit)
                if derived is not None and isinstance(o, torch.Tensor):
                    self._remember(o, o, derived)
                if f"{name}|fwd.output.{i}" in self._s.records:
                    self._s.returned[(name, i)] = (o, _local_version(o, self._dtensor))
        return hook

    def _final_hook(self, base: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Tuple[Any, ...], output: Any) -> None:
            if self._probing or _on_meta((output,), {}):
                return
            name = self._s.current.get(base, base)
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for i, o in enumerate(outs):
                if not isinstance(o, torch.Tensor) or not o.is_floating_point():
                    continue
                tid = f"{name}|fwd.output.{i}"
                if name in self._s.routed:
                    if o.requires_grad and torch.is_grad_enabled():
                        o.register_hook(self._output_grad(name, i))
                    continue
                if (name, i) in self._s.deferred:
                    self._s.deferred.discard((name, i))
                    self._record(name, "fwd.output", i, o)
                layout: Optional[Layout]
                try:
                    if _is_dtensor(o, self._dtensor):
                        dt = cast(Any, o)
                        layout = _placement_layout(tid, dt.placements, dt.device_mesh,
                                                   tuple(dt.shape), self._mesh_of(dt.device_mesh))
                        shape = tuple(dt.to_local().shape)
                    else:
                        layout = self._local_layout(tid, o)
                        shape = tuple(o.shape)
                        if layout is None:
                            recorded = self._s.forward.get((name, "fwd.output", i))
                            layout = recorded[1] if recorded is not None else None
                except UnsupportedLayoutError:
                    layout = None
                if layout is not None:
                    self._s.final[(name, i)] = (shape, layout)
                    self._rerecord_if_hooked(name, i, o, layout)
                    if not _is_dtensor(o, self._dtensor):
                        self._mark_unreduced(tid, o, layout)
                if o.requires_grad and torch.is_grad_enabled():
                    o.register_hook(self._output_grad(name, i))
        return hook

    def _mark_unreduced(self, tid: str, o: torch.Tensor, layout: Layout) -> None:
        """A module output its caller receives as a plain tensor made local from a DTensor's
        Partial() (a parallel style whose output layout is Partial, handed on with
        ``use_local_output``): marked in its module info, for the check to name the module
        when the sum's use fails (see :meth:`_record`)."""
        if getattr(o.grad_fn, "dtensor_spec", None) is None or tid not in self._s.meta:
            return
        axes = layout.partial_axes()
        if axes:
            meta = self._s.meta[tid]
            meta["module"] = {**(meta.get("module") or {}), "unreduced": axes}

    def _rerecord_if_hooked(self, name: str, i: int, o: torch.Tensor, layout: Layout) -> None:
        """An output hook that changed a module's output without changing its placement (a
        scale, a clamp, a bug planted as a hook): the caller receives the changed values, so
        they are the module's output — a difference they carry is born in this module, not in
        the gap after it. (The first record runs before the output hooks, where a DTensor's
        placement is still known; a parallel style's redistribution changes the layout and is
        left as recorded.)"""
        hit = self._s.returned.pop((name, i), None)
        if hit is None:
            return
        first, version = hit
        if o is first and _local_version(o, self._dtensor) == version:
            return  # untouched: no hook changed it (the usual case, free)
        tid = f"{name}|fwd.output.{i}"
        recorded = self._s.forward.get((name, "fwd.output", i))
        stored = self._s.records.get(tid)
        after = cast(Any, o).to_local() if _is_dtensor(o, self._dtensor) else o
        if (recorded is None or recorded[1] != layout or stored is None
                or tuple(after.shape) != tuple(stored.shape) or after.dtype != stored.dtype):
            return
        if o is first and isinstance(stored, ShardStats):
            # Changed in place, summaries only: the statistics tell.
            assert self._summarizer is not None
            fresh = self._summarizer.summarize(after, _DTYPES[after.dtype])
            if not torch.equal(fresh.values, stored.values):
                self._s.records[tid] = fresh
            return
        if o is first:
            # Changed in place: only the stored copy still holds what the module returned.
            same = torch.equal(after.detach().to("cpu"), cast(HostCopy, stored).wait())
        else:
            # A new tensor (a parallel style's to_local, or a hook's result): compared where
            # it lives, copied only if it differs.
            local = cast(Any, first).to_local() if _is_dtensor(first, self._dtensor) else first
            same = tuple(local.shape) == tuple(after.shape) and torch.equal(after, local)
        if not same and self._summarizer is not None:
            self._s.records[tid] = self._summarizer.summarize(after, _DTYPES[after.dtype])
        elif not same:
            copy = self._copier.copy(after)
            self._s.made.append(copy)
            self._s.records[tid] = copy

    def _output_grad(self, name: str, i: int) -> Callable[[torch.Tensor], None]:
        record = self._s

        def got(g: torch.Tensor) -> None:
            if self._s is record:
                self._put(name, "grad.output", i, g)
                if not record.tapped.get(name, False):
                    # No input takes a gradient: the parameters' come with this one.
                    record.order.append(("params", _base(name)))

        return got

    # -- writing ------------------------------------------------------------------------------

    def write(self, directory: Union[str, "os.PathLike[str]"], combine: bool = False) -> str:
        """Hand the recorded step to the writer: ``rank{r}.safetensors`` and
        ``manifest.rank{r}.json`` in ``directory``. Parameter gradients are read now and placed
        right after their module's backward tensors (execution order). With ``combine=True``
        (the last of several ranks emulated in one process) the fragments are then merged into
        ``manifest.json`` (see :func:`finish`). Returns the directory."""
        if self._summarizer is not None:
            raise InvalidInputError("a summaries-only tracer writes its steps from step()",
                                    "InvalidParameter")
        directory = os.fspath(directory)
        job = self._step_job(directory)
        self.last_directory = directory
        self._writer.hand(job)
        if combine:
            self.flush()
            finish(directory)
        return directory

    def _ordered(self) -> List[str]:
        """The step's ids in execution order, the parameter gradients read now and placed
        right after their module's backward tensors."""
        order: List[str] = []
        seen: Set[str] = set()
        for item in self._s.order:
            if isinstance(item, tuple):
                name = item[1]
                if name not in self._named:  # a functional site: no parameters
                    continue
                module = self._named[name]
                route = self._s.routed.get(name)
                for pname, p in module.named_parameters(recurse=False):
                    grad, info = _param_grad(module, pname, p)
                    experts = (None if grad is None or route is None else
                               self._put_expert_grads(name, pname, grad, info, route, seen))
                    if experts is not None:
                        order += experts
                    elif grad is not None:
                        self._record(name, "param", 0, grad, param=pname, info=info)
                        tid = f"{name}.{pname}|param_grad"
                        if tid not in seen and tid in self._s.records:
                            seen.add(tid)
                            order.append(tid)
            elif item not in seen:
                seen.add(item)
                order.append(item)
        return order

    def _step_job(self, directory: str) -> StepJob:
        """The recorded step as the writer (or the online check) takes it; a new step record
        begins."""
        # Each microbatch's loss may be its own mean: settled by the checker.
        dp_loss_auto = ((self.local_mean_loss is None and self.mesh.dp * self.mesh.cp > 1)
                        or self.microbatches > 1)
        order = fold(self._ordered(), self._s, self.microbatches, self.microbatch_dim,
                     self.unsupported == "skip", self.skipped)
        pipeline = None
        if self.stages > 1 or self.microbatches > 1:
            pipeline = (self.stages, self.stage, self.microbatches, self.file_rank,
                        self.microbatch_dim)
        job = step_job(directory, order, self._s, self.rank, self.mesh.to_json(),
                       self.recipe, dp_loss_auto, pipeline)
        self._s = _StepRecord()
        return job

    def _check_online(self, step: int) -> None:
        """Check the recorded step against the online reference with the other ranks (see
        :mod:`ttrace.tracer.online`); nothing is written but the report."""
        assert self._online is not None and self.directory is not None
        directory = os.path.join(self.directory, f"step{step}")
        job = self._step_job(directory)
        try:
            self.reports[step] = self._online.check(job, step, self.rank, self.mesh.world())
        finally:
            for c in job.made:
                c.release()
        self.last_directory = directory

    def _hand_summaries(self, step: int) -> None:
        """Hand the step's statistics to the writer: one line of
        ``summaries.rank{r}.jsonl`` in the tracer's directory."""
        assert self._summarizer is not None and self.directory is not None
        job = summary_job(self.directory, step, self._ordered(), self._s, self.rank,
                          self.mesh.to_json(), self._summarizer, self.skipped)
        self._s = _StepRecord()
        self.last_directory = self.directory
        self._writer.hand(job)

    @property
    def bytes_written(self) -> int:
        """Bytes of tensor data written so far (all steps)."""
        return self._writer.bytes_written

    def _drop_step(self) -> None:
        """Start a new step record, giving the unwritten copies' buffers back."""
        for c in self._s.made:
            c.release()
        self._s = _StepRecord()

    def flush(self) -> int:
        """Wait until every handed step is on disk; re-raises a write error. Returns the bytes
        written so far."""
        return self._writer.flush()

    def close(self) -> int:
        """Remove the hooks, wait for the writer and stop it. Returns the bytes written."""
        self.detach()
        for h in self._probe_handles:
            h.remove()
        self._probe_handles = []
        try:
            return self.flush()
        finally:
            self._writer.close()
            if self._online is not None:
                self._online.close()
            self._drop_step()
            self._copier.clear()
            self._closed = True

    def __enter__(self) -> "Tracer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
