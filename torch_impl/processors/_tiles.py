"""One call's operands as the engine's tiles (:class:`Tiles`) and what the sweeps need,
checked (:class:`TileSetup`, built by :mod:`._options`): the logits ``z = (h @ W.T + b) *
logit_scale / T`` a tile at a time (one ``torch.mm`` with an fp32 output). With a softcap
``s`` (``cap_k = logit_scale / s``, :func:`cap_factor`) they are ``z = c * inv_t`` of ``u =
h @ W.T + b`` capped (:func:`soft_cap_`: ``c = s * tanh(u * cap_k) / logit_scale`` formed
so that no finite ``s`` overflows), and ``dz/du = inv_t * (1 - tanh(u * cap_k)**2)``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch

from hookspec import Collectives

from ._gemm import gemm_into, scaled_
from ._geometry import KernelConfig

__all__ = ["TileSetup", "Tiles", "cap_factor", "read_in_backward", "soft_cap_"]


def _tiny_x(dtype: torch.dtype) -> float:
    """Below this ``|x|``, ``tanh(x) == x`` in ``dtype``: ``x**3 / 3`` is under half an ulp
    of ``x`` (``sqrt(eps / 2)``: ``2**-12`` in fp32, as the Triton kernels' ``X_TINY``)."""
    return math.sqrt(torch.finfo(dtype).eps / 2)


def cap_factor(logit_scale: float, softcap: float | None, dtype: torch.dtype) -> float | None:
    """``cap_k = logit_scale / softcap`` as the tiles of accumulation ``dtype`` use it::

        None          where cap_k * max(dtype) < sqrt(eps / 2): tanh(u cap_k) == u cap_k for
                      every finite u, the cap changes no logit
        sqrt(max)     where cap_k is larger: every capped logit is within logit_scale /
                      sqrt(max) * inv_t of 0 either way (5e-20 in fp32), and their tanh
                      stays readable from them (:meth:`Tiles.cap_slope_of`)
        cap_k         else

    Every finite ``softcap > 0`` is one of the three: none overflows or gives 0 * inf."""
    if softcap is None:
        return None
    info = torch.finfo(dtype)
    k = logit_scale / softcap  # a float64: inf only for a softcap below ~1e-308 * logit_scale
    if k * float(info.max) < _tiny_x(dtype):
        return None
    return min(k, math.sqrt(float(info.max)))


def read_in_backward(**tensors: torch.Tensor | None) -> tuple[tuple[str, torch.Tensor, int], ...]:
    """:attr:`TileSetup.versions` of the given tensors (by their fields' names; ``None``
    and inference tensors, which cannot change under autograd, left out)."""
    return tuple(
        (field, x, x._version)
        for field, x in tensors.items()
        if x is not None and not x.is_inference()
    )


def soft_cap_(u: torch.Tensor, cap_k: float, th: torch.Tensor) -> torch.Tensor:
    """``u [r, c]`` (or ``[r]``) capped in place and returned, ``tanh(x)`` into ``th`` (of
    ``u``'s shape)::

        x = u * cap_k
        th = tanh(x)
        u = where(|x| < sqrt(eps / 2), u, th / cap_k)     # = s * tanh(u / s) (s = 1 / cap_k)

    ``u`` itself where ``tanh(x) == x``: no ``1 / cap_k`` formed to overflow, no subnormal
    ``x`` to lose ``u``'s bits (the Triton kernels' ``_capped``)."""
    torch.mul(u, cap_k, out=th)
    keep = th.abs() < _tiny_x(u.dtype)
    th.tanh_()
    return torch.where(keep, u, th / cap_k, out=u)


@dataclasses.dataclass(frozen=True)
class TileSetup:
    """What the sweeps need, checked (built by :mod:`._options`)."""

    labels_local: torch.Tensor  # [n] long: the label's row in this shard, or -1
    ignored: torch.Tensor  # [n] bool
    inv_t: torch.Tensor | float  # [n] (acc dtype) or a number: logit_scale / T
    fold: bool  # inv_t is folded into the hidden rows (torch backend, fp32/fp64 compute)
    compute_dtype: torch.dtype
    acc_dtype: torch.dtype
    vocab_start: int
    vocab_size: int
    tile: tuple[int, int]  # (rows, cols) of the vocabulary sweep
    row_tile: int  # rows of the row sweep's whole-row tiles
    grad_capacity: int  # rows of the row sweep's gradient buffer (a multiple of row_tile)
    collectives: Collectives | None
    kernel: KernelConfig | None  # the Triton kernels' launch shape; None: the torch backend
    bias: torch.Tensor | None = None  # [V_local] as given (the caller's, with its graph), or None
    cap_k: float | None = None  # logit_scale / softcap; None: no softcap
    mean_weights: torch.Tensor | None = None  # [V_local] acc dtype: mean_logit = sum_j c_j z_j / V
    # (field, tensor, version at the call) of each tensor the backward reads that may be a
    # caller's (aliased by .to() where its dtype and layout already fit): check_versions.
    # Recorded at construction where not given: the mean logit's column weights (the bias
    # is saved for backward, autograd checks it; the labels and 1 / T are new tensors)
    versions: tuple[tuple[str, torch.Tensor, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.versions:
            versions = read_in_backward(mean_logit_weights=self.mean_weights)
            object.__setattr__(self, "versions", versions)

    def check_versions(self, function: str) -> None:
        """``RuntimeError`` where a tensor the backward reads was changed in place since the
        call, as autograd raises for a tensor it saved: its gradient would be of the new
        values (a caller's ``w.mul_(0)`` between forward and backward)."""
        for field, x, version in self.versions:
            if x._version != version:
                raise RuntimeError(
                    f"{function}: {field}, which the backward reads, has been modified by an "
                    f"inplace operation: it is at version {x._version}, expected version "
                    f"{version} (the call's). Change it after backward, or pass a clone"
                )

    def reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_reduce_max(x) if self.collectives is not None else x

    def reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_reduce_sum(x) if self.collectives is not None else x

    def row_inv_t(self, rows: slice, *, column: bool = True) -> torch.Tensor | float:
        """``inv_t`` of the rows: ``[r, 1]`` (``[r]`` without ``column``) or a number."""
        if not isinstance(self.inv_t, torch.Tensor):
            return self.inv_t
        return self.inv_t[rows, None] if column else self.inv_t[rows]


class Tiles:
    """The tiles of ``z = h @ W.T * inv_t`` for one call: ``hs`` the hidden rows in the
    compute dtype (times ``inv_t`` when folded), ``w`` the shard, reused buffers, and the
    temperature, applied here alone (folded into ``hs``, scaled per tile, or inside the
    Triton kernels): an epilogue reads tiles through :meth:`logits_of` and hands the
    gradient of the tempered logits to a :class:`~._sink.GradSink` (:meth:`untempered_grad`)."""

    def __init__(
        self, h: torch.Tensor, w: torch.Tensor, setup: TileSetup, *, need_db: bool = False
    ) -> None:
        self.setup = setup
        hs = h.detach().to(setup.compute_dtype)
        # z / T = (h / T) @ W.T: one multiply of the rows, not of every tile (fold: acc dtype
        # = compute)
        self.hs = hs * setup.row_inv_t(slice(None)) if setup.fold else hs
        self.w = w.detach()
        self.w_dtype = w.dtype
        self.triton = setup.kernel is not None  # the Triton backend
        self.n, self.local = int(hs.shape[0]), int(w.shape[0])
        self._bufs: dict[str, torch.Tensor] = {}
        self._w_all: torch.Tensor | None = None
        self._label: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.b = None if setup.bias is None else setup.bias.detach().to(setup.acc_dtype)
        self.db = torch.zeros_like(self.b) if need_db and self.b is not None else None  # acc dtype

    def buffer(self, name: str, r: int, c: int, dtype: torch.dtype) -> torch.Tensor:
        """A reused ``[r, c]`` buffer (one allocation per name), so that the loops do not
        allocate and page-fault a fresh tile each step."""
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < r * c or buf.dtype != dtype:
            buf = torch.empty(r * c, dtype=dtype, device=self.hs.device)
            self._bufs[name] = buf
        return buf[: r * c].view(r, c)

    def like(self, name: str, z: torch.Tensor) -> torch.Tensor:
        """A reused buffer of ``z``'s shape and dtype."""
        return self.buffer(name, z.shape[0], z.shape[1], z.dtype)

    def weight_all(self) -> torch.Tensor:
        """The whole shard in the compute dtype (kept for the call)."""
        if self._w_all is None:
            self._w_all = self.w.to(self.setup.compute_dtype)
        return self._w_all

    def logits(self, rows: slice, wc: torch.Tensor, cols: slice = slice(None)) -> torch.Tensor:
        """The tile ``u = h[rows] @ wc.T + b[cols]`` ``[r, c]`` in the accumulation dtype
        (``wc = W[cols]``): tempered on the torch backend (folded: ``(h inv_t) @ wc.T +
        inv_t b``), untempered on the Triton backend (its kernels apply ``inv_t``)."""
        hidden = self.hs[rows]
        tile = self.buffer("z", hidden.shape[0], wc.shape[0], self.setup.acc_dtype)
        z = gemm_into(tile, hidden, wc.T, first=True)
        if self.b is not None:  # folded: the bias times inv_t, as the rows are
            factor = self.setup.row_inv_t(rows, column=False) if self.setup.fold else 1.0
            if isinstance(factor, torch.Tensor):
                z.addr_(factor, self.b[cols])
            else:
                z.add_(self.b[cols], alpha=factor)
        if self.setup.cap_k is not None and not self.triton:  # tanh(u k) kept for cap_slope_
            soft_cap_(z, self.setup.cap_k, self.like("cap", z))
        return z if self.triton or self.setup.fold else scaled_(z, self.setup.row_inv_t(rows))

    def cap_slope_(self, gz: torch.Tensor) -> torch.Tensor:
        """``gz * (1 - tanh(u cap_k)**2)`` in place, the tile's tanh from :meth:`logits`
        (torch backend; its ``"cap"`` buffer is spent); ``gz`` unchanged without a softcap."""
        if self.setup.cap_k is None:
            return gz
        tanh = self.like("cap", gz)
        return gz.addcmul_(gz, tanh.mul_(tanh), value=-1.0)

    def cap_slope_of(self, zv: torch.Tensor, rows: slice) -> torch.Tensor | float:
        """``1 - tanh(u cap_k)**2`` of capped logits ``zv`` (``[r]``, or ``[r, k]``: a gather
        or a tile) of the rows (1 without a softcap)::

            t = zv / inv_t * cap_k                    # tanh(u cap_k), to a few roundings
            slope = where(1 - t**2 < 8 eps, 0, 1 - t**2)

        A slope under the rounding of ``t**2`` is 0: where the tanh saturated (``t = +-1``
        give or take an ulp) it would be ``+-2 eps`` instead of about 0."""
        if self.setup.cap_k is None:
            return 1.0
        t = zv / self.setup.row_inv_t(rows, column=zv.dim() == 2) * self.setup.cap_k
        slope = 1.0 - t * t
        return slope.masked_fill_(slope < 8 * torch.finfo(slope.dtype).eps, 0.0)

    def logits_of(
        self, values: torch.Tensor, rows: slice, *, inplace: bool = False
    ) -> torch.Tensor:
        """Values read from a tile of :meth:`logits` (``[r, k]``, a gather or a max; or
        ``[r]``; or the tile itself, ``inplace``) as the tempered logits ``z``."""
        if not self.triton:
            return values
        column = values.dim() == 2
        if self.setup.cap_k is None:
            return scaled_(
                values if inplace else values.clone(), self.setup.row_inv_t(rows, column=column)
            )
        c = values if inplace else values.clone()
        soft_cap_(c, self.setup.cap_k, torch.empty_like(c))
        return scaled_(c, self.setup.row_inv_t(rows, column=column))

    def untempered_grad(self, gz: torch.Tensor, rows: slice) -> torch.Tensor:
        """The gradient of tempered logits in the sink's GEMMs' form: times ``inv_t``
        (in place) unless the temperature is folded into the hidden rows. With a softcap
        ``gz`` comes times its slope (:meth:`cap_slope_of`, the caller's: elementwise)."""
        return gz if self.setup.fold else scaled_(gz, self.setup.row_inv_t(rows))

    def bias_grad_(
        self, g: torch.Tensor, rows: slice, cols: Any = slice(None), scale: Any = None
    ) -> None:
        """``db[cols] += sum_i w_i g[i]`` (``db = sum_i dL/du_i``) for ``g`` in the GEMMs' form,
        ``[r, c]`` of the columns ``cols``, or ``[r, k]`` at the local columns ``cols`` (-1:
        none, ``g`` 0 there); ``w = scale`` (1 when None), times ``inv_t`` where folded."""
        if self.db is None:
            return
        w = self.setup.row_inv_t(rows, column=False) if self.setup.fold else 1.0
        w = w if scale is None else scale * w
        if isinstance(cols, torch.Tensor):
            g = g * (w[:, None] if isinstance(w, torch.Tensor) else w)
            self.db.index_add_(0, cols.clamp(min=0).reshape(-1), g.reshape(-1).to(self.db.dtype))
            return
        wv = w.to(g.dtype) if isinstance(w, torch.Tensor) else g.new_full((g.shape[0],), w)
        gemm_into(self.db[cols].view(1, -1), wv[None], g, first=False)

    def unfold_dh(self, dh: torch.Tensor | None) -> torch.Tensor | None:
        """``dh = d(hs) * inv_t`` when the temperature was folded into the hidden rows."""
        return (
            dh
            if dh is None or not self.setup.fold
            else scaled_(dh, self.setup.row_inv_t(slice(None)))
        )

    def label_columns(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(hit [r], col [r, 1], keep [r, 1])`` of whole rows: the label is in this shard,
        its column (clamped), and 0 there (compute dtype), else 1; made once a call."""
        if self._label is None:
            hit = self.setup.labels_local >= 0
            col = self.setup.labels_local.clamp(min=0)[:, None]
            self._label = (hit, col, (~hit).to(self.setup.compute_dtype)[:, None])
        hit, col, keep = self._label
        return hit[rows], col[rows], keep[rows]

    def vocab_tiles(self) -> Iterator[tuple[slice, slice, torch.Tensor, torch.Tensor]]:
        """The vocabulary sweep's tiles ``(rows, cols, W[cols], logits)``, columns outer
        (each ``W`` tile converted once)."""
        height, width = self.setup.tile
        for col0 in range(0, self.local if self.n else 0, width):
            cols = slice(col0, min(col0 + width, self.local))
            wc = (
                self.w[cols].to(self.setup.compute_dtype)
                if self._w_all is None
                else self._w_all[cols]
            )
            for row0 in range(0, self.n, height):
                rows = slice(row0, min(row0 + height, self.n))
                yield rows, cols, wc, self.logits(rows, wc, cols)

    def row_tiles(self) -> Iterator[tuple[slice, torch.Tensor]]:
        """The row sweep's tiles ``(rows, logits)`` of whole rows of the shard."""
        height = self.setup.row_tile
        for row0 in range(0, self.n if self.local else 0, height):
            rows = slice(row0, min(row0 + height, self.n))
            yield rows, self.logits(rows, self.weight_all())
