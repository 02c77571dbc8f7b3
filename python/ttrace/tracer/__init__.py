"""Record PyTorch training steps as ttrace trace directories.

Attach a :class:`Tracer` to the model on every rank, run the step inside ``tracer.step()``,
then ``tracer.close()``; compare with :func:`ttrace.check` (or ``python -m ttrace check``)::

    tracer = ttrace.Tracer(model, "traces/candidate")
    with tracer.step():
        model(batch).sum().backward()
    tracer.close()                      # waits for the background writer
    ttrace.check("traces/reference/step0", "traces/candidate/step0")

Step ``n`` (counting every ``step()``) is written to ``DIRECTORY/step{n}``: on each rank
``rank{r}.safetensors`` and ``manifest.rank{r}.json`` (``ttrace check`` merges the fragments).

What is recorded, under canonical ids (``papers/trace-format.md``):

* ``{module}|fwd.input.{i}``, ``{module}|fwd.output.{i}``: floating-point arguments and outputs
  of each traced module (forward hooks); a module called again in the same step records its
  k-th further call as ``{module}#k`` (a recomputation by activation checkpointing, inside the
  backward pass, is not a further call: it records onto the ids of the calls it repeats);
* ``{module}|grad.output.{i}``, ``{module}|grad.input.{i}``: gradients arriving at and leaving
  each module. They are tapped, not caught with PyTorch's full backward hooks (which hand the
  module views of its inputs and forbid the in-place ops real modules do — Megatron's masked
  softmax, ``ReLU(inplace=True)``): each input that requires a gradient reaches the module as
  a copy made by an autograd function that records the gradient flowing back through it, and
  each output carries a tensor hook. The copies cost one extra input per traced module during
  traced steps;
* ``{module}.{param}|param_grad``: parameter gradients, read when the step ends.

Layouts — how the ranks' shards form the logical tensor — are found without declarations:

* **DTensor** (``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` /
  ``SequenceParallel``, ``fully_shard``): a DTensor is recorded as its local shard with the
  layout of its ``placements`` on its ``device_mesh``: ``Shard(d)`` → split along d,
  ``Replicate()`` → replicated, ``Partial()`` → partial sum. Mesh dimensions are mapped to
  ttrace's axes by name (``tp``/``tensor``/``model`` → tp; ``dp``/``data``/``fsdp``/``shard``/
  ``replicate``/``ddp`` → dp; ``cp``/``context``/``seq`` → cp) or by ``axes={"tp": "my_dim"}``.
  A parameter gradient FSDP2 shards again over a TP shard (``_StridedShard``), or HSDP places
  two ways on one axis, is gathered when read. Another placement the format cannot express
  (an uneven ``Shard``, ``Partial("avg")``, a strided shard, two mesh dimensions placing one
  axis differently) raises :class:`ttrace.UnsupportedLayoutError` naming
  the tensor and the placement — or, with ``unsupported="skip"``, the tensor is left out and
  listed in ``tracer.skipped`` (as is a tensor whose storage torch released before the hook
  could read it, otherwise a :class:`ttrace.TtraceError`).
* **Megatron-LM** ``ColumnParallelLinear``, ``RowParallelLinear`` and
  ``VocabParallelEmbedding`` (recognized by class, without importing Megatron).
* **Plain tensors** under data parallelism (DDP, or FSDP's unsharded activations): split along
  ``dp_dim`` (the batch) across the dp ranks; parameters and their gradients replicated. A
  ``DistributedDataParallel`` wrapper is looked through: module names are the wrapped model's.
* Anything else can be declared per module with ``layouts={name: ModuleLayout(...)}`` (the
  tensor-parallel placements of an emulation in one process, for instance) — or left to the
  checker: a layout the tracer could not know (plain tensors of a hand-written engine or of
  functional code, the batch dimension under data parallelism) is written as a guess, with the
  guessed axes, and the checker settles it from the shards' and the reference's shapes
  (``papers/trace-format.md``).

Without ``torch.distributed`` (or with one process) the trace is a reference: one rank.

Cheap and selective: ``modules=`` chooses what to trace (names, ``fnmatch`` patterns or a
predicate; default: the leaf modules, the attention cores, parameter-free modules named
attention, and grouped experts, traced whole), ``every=N`` traces one step in N (hooks are attached
only during traced steps), and a background thread writes the files so the step does not wait
on the disk; ``tracer.bytes_written`` counts what it wrote. On a CUDA device the copies are
queued on the tensor's stream into pinned, reused host buffers (``pool_bytes``, see
:mod:`ttrace._copies`): recording never waits for the device. ``summaries=True`` records a
few statistics per tensor instead, every traced step (:mod:`ttrace._summaries`,
``papers/summaries.md``), compared with :func:`ttrace.check_summaries`.

The package, one concern per module: :mod:`~ttrace.tracer.core` (the hooks),
:mod:`~ttrace.tracer.record` (what a step records), :mod:`~ttrace.tracer.keep` (what a
recorded tensor becomes: a host copy or its statistics), :mod:`~ttrace.tracer.placements`,
:mod:`~ttrace.tracer.dtensor` and :mod:`~ttrace.tracer.megatron` (layouts per engine),
:mod:`~ttrace.tracer.kinds`, :mod:`~ttrace.tracer.sites` (functional attention) and
:mod:`~ttrace.tracer.writing` (through the Rust core). The helpers for tests that build a
sharded model beside its reference (:func:`~ttrace.testing.seed_everything`,
:func:`~ttrace.testing.copy_sharded`) live in :mod:`ttrace.testing` and are re-exported here.
"""

from __future__ import annotations

from ..testing import copy_sharded, seed_everything
from .core import Tracer
from .placements import (Layout, Mesh, ModuleLayout, Placement, column_parallel, partial, replicate,
                         row_parallel, split)
from .writing import finish

__all__ = [
    "Layout",
    "Mesh",
    "ModuleLayout",
    "Placement",
    "Tracer",
    "column_parallel",
    "copy_sharded",
    "finish",
    "partial",
    "replicate",
    "row_parallel",
    "seed_everything",
    "split",
]

