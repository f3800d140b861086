"""The options every tensor function takes (:class:`LinearOptions`), and the one
prologue that checks a call's tensors against them and builds the engine's
:class:`~._engine.TileSetup`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

from hookspec import (
    IGNORE_INDEX,
    Collectives,
    ContractError,
    SingleProcessCollectives,
    VocabShard,
)
from hookspec.arrays import format_shape
from hookspec.collectives import checked_collectives

from ..value_checks import check_finite_deferred
from ._backends import auto_choice, triton_available
from ._checks import (
    FLOATS,
    check_bool,
    check_finite_number,
    check_floating,
    check_instance,
    check_int,
    check_temperature,
    check_token_labels,
    describe_tensor,
    resolve_compute_dtype,
)
from ._engine import TileSetup
from ._geometry import (
    grad_capacity,
    interpreting,
    kernel_config,
    row_tile,
    sweep_tile,
    triton_mode_mismatch,
)
from ._tiles import cap_factor

__all__ = [
    "LinearOptions",
    "prologue",
    "refuse_unexpected",
]

Backend = Literal["auto", "torch", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")


@dataclasses.dataclass(frozen=True)
class LinearOptions:
    """How a tensor function forms, shards and tiles the logits
    ``z = gather(hidden) @ weight_full.T * logit_scale / temperature``; checked at
    construction (``ContractError``), the tensors' shapes at the call.

    Attributes:
        temperature: ``T > 0``, a number or a tensor ``[n]`` (one per gathered row; not
            differentiated).
        logit_scale: a constant factor ``> 0`` on the logits (MuP's output multiplier).
        ignore_index: the label of rows that count nowhere (logprob 0).
        vocab: the weight's rows ``[vocab.start, vocab.end)`` of ``vocab.size``;
            ``None``: the whole vocabulary. A shard needs ``collectives``.
        collectives: the vocab-parallel group's ``hookspec.Collectives`` (the
            reductions, ``gather_hidden_states``); ``None`` for one process.
        backend: ``"triton"`` (Triton kernels for the passes over each tile; on a CPU
            only under ``TRITON_INTERPRET=1``), ``"torch"``, or ``"auto"``: the device
            class's measured choice, else Triton on CUDA where installed, else torch.
        compute_dtype: the GEMM operands' dtype, accumulating in fp32 (fp64); default
            float64 where an input is, float32 on a CPU, the input dtype elsewhere.
        tile_rows, tile_cols: the tile (rows by vocabulary entries; row sweeps read ``tile_rows``
            only); ``None``: the device's default (``TILE_BYTES``, ``TILES_BY_DEVICE``).
        check_values: check the labels' and a tensor temperature's values (deferred on a GPU).
        softcap: ``s > 0`` caps the logits before the temperature (Gemma's
            ``final_logit_softcapping``): ``z = s * tanh(u * logit_scale / s) / T``; ``None``: off.

    Equal options have equal fields, a tensor temperature the same object (comparing
    its values would be a host read); the hash agrees.
    """

    temperature: float | torch.Tensor = 1.0
    logit_scale: float = 1.0
    ignore_index: int = IGNORE_INDEX
    vocab: VocabShard | None = None
    collectives: Collectives | None = None
    backend: Backend = "auto"
    compute_dtype: torch.dtype | None = None
    tile_rows: int | None = None
    tile_cols: int | None = None
    check_values: bool = True
    softcap: float | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        temperature = self.temperature
        if not isinstance(temperature, torch.Tensor):
            check_temperature(temperature, 1)
        elif (
            temperature.dim() > 0 and check_floating("temperature", temperature).dim() != 1
        ):  # a [b, s] is not the rows
            raise ContractError(
                "temperature",
                expected="a number or a tensor [n] (one per gathered row, s-major)",
                actual=format_shape(temperature.shape),
            )
        put(
            self,
            "logit_scale",
            check_finite_number("logit_scale", self.logit_scale, low=0.0, low_open=True),
        )
        check_int("ignore_index", self.ignore_index, low=-(1 << 62))
        if self.vocab is not None and not isinstance(self.vocab, VocabShard):
            raise ContractError(
                "vocab", expected="None or a hookspec.VocabShard", actual=repr(self.vocab)
            )
        if self.collectives is not None:
            expected = (
                "None or a hookspec.Collectives (all_reduce_sum, all_reduce_max, "
                "gather_hidden_states)"
            )
            check_instance("collectives", self.collectives, Collectives, expected)
        if self.backend not in BACKENDS:
            raise ContractError("backend", expected=f"one of {BACKENDS}", actual=repr(self.backend))
        if self.compute_dtype is not None and self.compute_dtype not in FLOATS:
            expected = "a floating torch dtype"
            raise ContractError("compute_dtype", expected=expected, actual=repr(self.compute_dtype))
        for name in ("tile_rows", "tile_cols"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), low=1)
        check_bool("check_values", self.check_values)
        if self.softcap is not None:
            put(
                self,
                "softcap",
                check_finite_number("softcap", self.softcap, low=0.0, low_open=True),
            )

    def _key(self) -> tuple[Any, ...]:
        """The fields, a tensor temperature as its identity."""
        t = self.temperature
        temperature = ("tensor", id(t)) if isinstance(t, torch.Tensor) else ("number", t)
        rest = (getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "temperature")
        return (temperature, *rest)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


# The keywords that left the signatures, and where each went.
RENAMED: dict[str, str] = {
    "token_chunk_size": "tile_rows",
    "vocab_chunk_size": "tile_cols",
    "chunk_size": "tile_cols",
    "tile_elements": "tile_rows (= tile_elements // V_local)",
    "fused_tile_elements": "tile_rows (= fused_tile_elements // V_local)",
    "vocab_start": "vocab=VocabShard(start, end, size)",
    "vocab_size": "vocab=VocabShard(start, end, size)",
}


def refuse_unexpected(function: str, extra: dict[str, Any], *, options: bool = False) -> None:
    """Raise ``TypeError`` for keywords a signature does not take (``**unexpected:
    Never``), naming where a moved one went: a field of :class:`LinearOptions`
    (``options``: a tensor function's), else the factory's ``tile_rows=``/``tile_cols=``."""
    if not extra:
        return
    if options:
        known = RENAMED.keys() | {f.name for f in dataclasses.fields(LinearOptions)}
        moved = [f"{k}= -> LinearOptions({RENAMED.get(k, k)})" for k in sorted(extra) if k in known]
        where = "into options=LinearOptions(...)"
    else:  # a factory takes the tiles only
        moved = [
            f"{k}= -> {RENAMED[k]}" for k in sorted(extra) if RENAMED.get(k, "").startswith("tile_")
        ]
        where = "to tile_rows= and tile_cols= (LinearOptions' names)"
    hint = f": the options moved {where}: {'; '.join(moved)}" if moved else ""
    raise TypeError(f"{function}() got unexpected keyword arguments {sorted(extra)}{hint}")


def prologue(
    function: str,
    hidden: Any,
    weight: Any,
    labels: Any,
    options: LinearOptions | None,
    unexpected: dict[str, Any],
    *,
    fold: bool = True,
    bias: Any = None,
    mean_weights: Any = None,
) -> tuple[LinearOptions, torch.Tensor, TileSetup]:
    """Every tensor function's first lines, ``(options, h, setup)``: ``options`` (default
    ``LinearOptions()``) with its collectives' results checked; ``h`` the checked ``hidden``
    gathered to the rows every vocab shard needs (``gather_hidden_states``); ``setup``
    the call's :class:`TileSetup` from the checked ``weight``, ``labels``, ``bias`` and
    mean-logit column weights (each ``None`` where absent). ``fold``: the torch backend
    may scale the rows by ``1 / T``, not each tile (not where equal logits must stay equal).

    The numbered steps run in this order, each raising for the field it checks: a call
    with several faults names the same one every time."""
    # 1. the options, with the collectives' results checked where they return
    options = _checked_options(function, options, unexpected)
    # 2. the hidden rows gathered; the weight floating; no torch.func transform around them
    h = _gathered_rows(hidden, weight, labels, options)
    # 3. the weight: the shard's rows, as wide as h, on h's device
    start, size, local = _checked_weight(weight, h, options)
    n = int(h.shape[0])
    # 4. the backend, then the labels and the temperature of every row
    triton = _backend(options.backend, h, weight)
    y = _checked_labels(labels, n, size, options, h.device)
    temperature = check_temperature(options.temperature, n, check_values=options.check_values)
    # 5. the compute and accumulation dtypes, and logit_scale / T in the latter
    cdtype, acc = _dtypes(h, weight, options, triton)
    inv_t = _inverse_temperature(temperature, options.logit_scale, h.device, acc)
    # 6. the optional columns: the bias and the mean logit's column weights
    bias = None if bias is None else check_bias(bias, weight, options.check_values)
    mean_weights = _checked_mean_weights(mean_weights, local, h.device, acc)
    # 7. the setup: the labels as this shard's columns, the tiles, the kernels' shape; a
    #    softcap's tanh sits between u and 1 / T: nothing to fold into the rows. It records
    #    the version of each tensor of the caller's that the backward reads
    labels_local, ignored = _shard_columns(y, options.ignore_index, start, local)
    full_width = cdtype in (torch.float32, torch.float64)
    setup = TileSetup(
        labels_local=labels_local,
        ignored=ignored,
        inv_t=inv_t,
        fold=fold and not triton and full_width and options.softcap is None,
        compute_dtype=cdtype,
        acc_dtype=acc,
        vocab_start=start,
        vocab_size=size,
        collectives=options.collectives,
        kernel=kernel_config(h.device) if triton else None,
        bias=bias,
        cap_k=cap_factor(options.logit_scale, options.softcap, acc),
        mean_weights=mean_weights,
        **_tile_shape(n, local, h.device, options, triton=triton, dtype=cdtype),
    )
    return options, h, setup


def _checked_options(
    function: str, options: LinearOptions | None, unexpected: dict[str, Any]
) -> LinearOptions:
    """Step 1: no keyword the signature lost, ``options`` a :class:`LinearOptions` (default
    ``LinearOptions()``), its collectives wrapped so that each result is checked where it
    returns (for the tensor-parallel size its vocabulary shard implies)."""
    refuse_unexpected(function, unexpected, options=True)
    options = LinearOptions() if options is None else options
    if not isinstance(options, LinearOptions):
        raise ContractError(
            "options",
            expected="a torch_impl.processors.LinearOptions",
            actual=type(options).__name__,
        )
    vocab = options.vocab
    tp = 1 if vocab is None else max(1, vocab.size // (vocab.end - vocab.start))
    checked = checked_collectives(options.collectives, tp_size=tp)
    if checked is not options.collectives:
        options = dataclasses.replace(options, collectives=checked)
    return options


def _gathered_rows(hidden: Any, weight: Any, labels: Any, options: LinearOptions) -> torch.Tensor:
    """Step 2: ``hidden`` floating ``[n, h]``, gathered over the vocab-parallel group
    (``gather_hidden_states``) where there is one; ``weight`` floating; no tensor of the
    call wrapped by a ``torch.func`` transform."""
    if check_floating("hidden", hidden).dim() != 2:
        raise ContractError("hidden", expected="2 dims [n, h]", actual=format_shape(hidden.shape))
    collectives = options.collectives
    h = hidden if collectives is None else collectives.gather_hidden_states(hidden)
    check_floating("weight", weight)
    refuse_function_transforms(
        hidden=h, weight=weight, labels=labels, temperature=options.temperature
    )
    return h


def _checked_weight(
    weight: torch.Tensor, h: torch.Tensor, options: LinearOptions
) -> tuple[int, int, int]:
    """Step 3: ``weight`` (floating: step 2) ``[V_local, h]`` on ``h``'s device, and the
    shard it holds: ``(start, size, V_local)`` of the vocabulary (``(0, V_local, V_local)``
    without ``options.vocab``)."""
    width = h.shape[1]
    if weight.dim() != 2 or weight.shape[1] != width:
        raise ContractError(
            "weight", expected=f"shape [V_local, h={width}]", actual=format_shape(weight.shape)
        )
    if weight.device != h.device:
        raise ContractError("weight", expected=f"on {h.device}", actual=str(weight.device))
    local = int(weight.shape[0])
    vocab = options.vocab
    if vocab is None:
        return 0, local, local
    _check_shard(vocab, local, options.collectives)
    return vocab.start, vocab.size, local


def _checked_labels(
    labels: Any, n: int, size: int, options: LinearOptions, device: torch.device
) -> torch.Tensor:
    """Step 4: the rows' labels, long on ``device``, each in ``[0, size)`` or
    ``options.ignore_index`` (values read where ``check_values``); ``None``: every row
    ignored (the tensor functions that read no label)."""
    if labels is None:
        return torch.full((n,), options.ignore_index, dtype=torch.long, device=device)
    checked = check_token_labels(
        labels, n, size, options.ignore_index, check_values=options.check_values
    )
    return checked.to(device=device, dtype=torch.long)


def _dtypes(
    h: torch.Tensor, weight: torch.Tensor, options: LinearOptions, triton: bool
) -> tuple[torch.dtype, torch.dtype]:
    """Step 5: ``(compute, accumulation)`` dtypes: the compute dtype as
    :func:`~._checks.resolve_compute_dtype` resolves it (float64 if either operand is, as
    torch would promote; Triton's default is the input dtype, on a CPU too); the
    accumulation dtype float64 for float64 compute, else float32."""
    wide = torch.float64 if torch.float64 in (h.dtype, weight.dtype) else h.dtype
    cdtype = resolve_compute_dtype(
        h.device, wide, options.compute_dtype or (h.dtype if triton else None)
    )
    if triton and cdtype == torch.float64:
        raise ContractError(
            "compute_dtype", expected="not float64 with backend 'triton'", actual="float64"
        )
    return cdtype, (torch.float64 if cdtype == torch.float64 else torch.float32)


def _inverse_temperature(
    temperature: torch.Tensor | float, scale: float, device: torch.device, acc: torch.dtype
) -> torch.Tensor | float:
    """Step 5: ``logit_scale / T``, per row ``[n]`` in the accumulation dtype or a number.
    In the accumulation dtype, a float32 temperature with float64 inputs gives an exact
    float64 quotient of its (float32) values."""
    if isinstance(temperature, torch.Tensor):
        return (scale / temperature.to(device=device, dtype=acc)).contiguous()
    return scale / temperature


def _checked_mean_weights(
    weights: Any, local: int, device: torch.device, acc: torch.dtype
) -> torch.Tensor | None:
    """Step 6: the mean logit's column weights ``c [V_local]`` (``mean_logit = sum_j c_j z_j /
    V``), detached, contiguous in the accumulation dtype; ``None`` stays ``None``."""
    if weights is None:
        return None
    shape_ok = isinstance(weights, torch.Tensor) and weights.shape == (local,)
    if not (shape_ok and weights.dtype.is_floating_point):
        raise ContractError(
            "mean_logit_weights",
            expected=f"None or a floating tensor [V_local={local}]",
            actual=describe_tensor(weights),
        )
    return weights.detach().to(device=device, dtype=acc).contiguous()


def _shard_columns(
    labels: torch.Tensor, ignore_index: int, start: int, local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 8: ``(labels_local, ignored)`` ``[n]``: each label's column in this shard (-1
    where it is in another shard or ignored) and the ignored rows."""
    ignored = labels == ignore_index
    local_row = labels - start
    in_shard = (local_row >= 0) & (local_row < local) & ~ignored
    return torch.where(in_shard, local_row, -1), ignored


def _tile_shape(
    n: int,
    local: int,
    device: torch.device,
    options: LinearOptions,
    *,
    triton: bool,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """Step 8: :class:`TileSetup`'s ``tile``, ``row_tile`` and ``grad_capacity`` for ``n``
    rows of ``local`` columns: the vocabulary sweep's tile, the row sweep's rows and its
    gradient buffer's rows (of ``dtype``, the compute dtype), each the device's default
    unless ``options.tile_rows`` / ``tile_cols`` set it (:mod:`._geometry`)."""
    rows = row_tile(n, local, device, rows=options.tile_rows)
    tile = sweep_tile(
        n, local, device, triton=triton, rows=options.tile_rows, cols=options.tile_cols
    )
    itemsize = torch.empty((), dtype=dtype).element_size()
    capacity = grad_capacity(n, local, rows, itemsize, device)
    return {"tile": tile, "row_tile": rows, "grad_capacity": capacity}


def check_bias(bias: Any, weight: torch.Tensor, check_values: bool) -> torch.Tensor:
    """The output layer's bias: ``[V_local]``, ``weight``'s dtype and device, finite
    (read when ``check_values``: at once on a CPU, deferred on a GPU)."""
    check_floating("bias", bias)
    shape = ("shape [V_local]", format_shape(weight.shape[:1]), format_shape(bias.shape))
    checks = [shape, ("dtype", weight.dtype, bias.dtype), ("device", weight.device, bias.device)]
    for what, want, got in checks:
        if want != got:
            raise ContractError("bias", expected=f"the weight's {what}: {want}", actual=str(got))
    if check_values:
        check_finite_deferred(bias, field="bias")
    return bias


def _backend(backend: str, h: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Triton kernels run: ``"auto"`` takes the device class's choice
    (:mod:`._backends`) for bf16/fp16/fp32, torch for float64."""
    fp64 = torch.float64 in (h.dtype, weight.dtype)
    if backend != "triton":
        return backend == "auto" and not fp64 and auto_choice(h.device).backend == "triton"
    if fp64:
        expected = "'torch' for float64 inputs (the kernels run in fp32)"
    elif not triton_available():
        expected = "'torch' or 'auto' (triton is not installed)"
    elif mismatch := triton_mode_mismatch():
        expected = f"a Triton in one mode: {mismatch}"
    elif not (h.is_cuda or interpreting()):
        expected = f"'torch' or 'auto' for tensors on {h.device} (or TRITON_INTERPRET=1)"
    else:
        return True
    raise ContractError("backend", expected=expected, actual="'triton'")


def _check_shard(vocab: VocabShard, local: int, collectives: Collectives | None) -> None:
    """The shard is the weight's rows, and a part of the vocabulary comes with collectives
    over the other parts (with none, or one rank's, logprobs would be this shard's alone)."""
    if vocab.end - vocab.start != local:
        raise ContractError(
            "vocab",
            expected=f"a shard of V_local = {local} rows, the weight's (end - start)",
            actual=f"start={vocab.start}, end={vocab.end} ({vocab.end - vocab.start} rows)",
        )
    whole = vocab.start == 0 and vocab.end == vocab.size
    if not whole and (collectives is None or isinstance(collectives, SingleProcessCollectives)):
        raise ContractError(
            "collectives",
            expected=(
                f"the vocab-parallel group's Collectives: the weight holds rows [{vocab.start}, "
                f"{vocab.end}) of a vocabulary of {vocab.size}, the rest lives on other ranks"
            ),
            actual="None" if collectives is None else "SingleProcessCollectives() (one rank)",
        )


def refuse_function_transforms(**tensors: Any) -> None:
    """Refuse a call under a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``),
    naming the first of ``tensors`` it wraps: the gradients are formed in tiles outside
    autograd (an old-style ``autograd.Function``, no vmap rule)."""
    functorch = getattr(torch._C, "_functorch", None)
    if functorch is None or functorch.maybe_current_level() is None:
        return
    is_wrapped = functorch.is_functorch_wrapped_tensor
    wrapped = [k for k, v in tensors.items() if isinstance(v, torch.Tensor) and is_wrapped(v)]
    raise ContractError(
        wrapped[0] if wrapped else next(iter(tensors)),
        expected="a tensor outside torch.func transforms: vmap, grad, jacrev and jvp are not "
        "supported (the gradients are formed in tiles outside autograd); use "
        "torch.autograd.grad, and batch rows instead of vmap (the functions take any number "
        "of rows)",
        actual="a call inside a torch.func transform",
    )
