"""The host reads known in the processors, by site: shared by the host-read test and
the compile test (which expects a recorded call to stop only at one of them)."""

from __future__ import annotations

FUSED_BACKWARD = "`bool(g_loss == 1)` in fused_token_loss's backward (_fused.py)"
TOPK_TILE = "`bool(tied.any())` in every top-k tile (_topk.py `_tile_topk`, the tie rule)"
